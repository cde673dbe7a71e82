"""Fault injection for tests: make a real rank fail at a chosen point, cheaply.

:mod:`tests.faults.inject` has the tools (kill or stop a rank at its n-th call of an op,
drop a handle, close the loop under an await, a bad argument on one rank only);
:mod:`tests.faults.scenarios` uses each once on real gloo ranks and under mpiexec, and
test_faults.py asserts what docs/reliability.md promises for each.
"""
