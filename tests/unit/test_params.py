"""overlap.params: which parameters a reducer takes, and the checks on the ones it skips."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overlap.params import select, unfrozen_message


def _model() -> nn.Module:
    m = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 2))
    m[1].requires_grad_(False)
    return m


def test_trainable_once_frozen_named() -> None:
    m = _model()
    m.add_module("tied", nn.Linear(3, 2))
    m.tied.weight = m[2].weight  # tied: taken once
    sel = select(m, "X")
    assert [id(p) for p in sel.params] == [
        id(p) for p in (m[0].weight, m[0].bias, m[2].weight, m[2].bias, m.tied.bias)
    ]
    assert [n for n, _ in sel.frozen] == ["1.weight", "1.bias"]
    assert sel.unfrozen() == []
    m[1].bias.requires_grad_(True)
    assert sel.unfrozen() == ["1.bias"]


def test_a_list_of_parameters_is_named_by_position() -> None:
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2), requires_grad=False)
    sel = select([a, b, a], "X")
    assert sel.params == [a] and sel.frozen == [("parameter 1", b)]


def test_refusals_name_the_fix() -> None:
    with pytest.raises(TypeError, match="expected parameters, got int"):
        select([nn.Parameter(torch.ones(1)), 3], "X")  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"^0\.weight is not initialised yet .* then build the X$"):
        select(nn.Sequential(nn.LazyLinear(2)), "X")
    with torch.device("meta"):
        deferred = nn.Linear(2, 2)
    deferred.weight.requires_grad_(False)  # frozen ones too: they are broadcast at the start
    # before: a DiLoCo raised torch's "Cannot copy out of meta tensor; no data!"
    with pytest.raises(ValueError, match=r"^weight is on the meta device, .*model\.to_empty\(.*X$"):
        select(deferred, "X")


def test_the_unfrozen_message_names_the_parameters_or_the_ranks() -> None:
    names = [f"p{i}" for i in range(7)]
    mine = unfrozen_message(names, "X")
    assert mine.startswith("'p0', 'p1', 'p2', 'p3', 'p4' and 2 more did not require grad "), mine
    assert mine.endswith("call remove() and build a new X over the model"), mine
    theirs = unfrozen_message([], "X", [1, 3])
    assert theirs.startswith("ranks 1, 3 unfroze parameters that did not require grad when "), (
        theirs
    )
    assert unfrozen_message([], "X", [2]).startswith("rank 2 unfroze")


def test_a_selection_records_parameters_assigned_into_its_module() -> None:
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    sel = select(m, "BucketScheduler")
    other = select(nn.Linear(2, 2), "BucketScheduler")
    m[0].weight = m[0].weight  # one of its own: no change
    m[1].weight = m[0].weight  # tied after the fact: still its own
    assert sel.changed == []
    m[0].bias = nn.Parameter(torch.zeros(2), requires_grad=False)  # watched as frozen
    assert sel.changed == [] and [n for n, _ in sel.frozen] == ["0.bias"]
    m[0].bias.requires_grad_(True)
    assert sel.unfrozen() == ["0.bias"]
    m.append(nn.Linear(2, 1))
    assert sel.changed == [
        "'2.weight' was assigned a parameter of the new submodule '2'",
        "'2.bias' was assigned a parameter of the new submodule '2'",
    ]
    m[2].extra = nn.Parameter(torch.ones(1))  # the new submodule is watched too
    assert sel.changed[-1] == "'2.extra' was assigned a new Parameter"
    assert other.changed == []  # another model's selection saw nothing
    sel.unwatch()
    m[1].bias = nn.Parameter(torch.zeros(2))
    assert len(sel.changed) == 3  # no longer watched


def test_a_change_is_undone_when_the_original_parameter_is_put_back() -> None:
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    sel = select(m, "BucketScheduler")
    w0, w1 = m[0].weight, m[1].weight
    m[0].weight = nn.Parameter(torch.zeros(2, 2))
    m[1].weight = nn.Parameter(torch.zeros(2, 2))
    assert len(sel.changed) == 2
    m[0].weight = w0  # put back: that change is gone, the other stays
    assert sel.changed == ["'1.weight' was assigned a new Parameter"]
    m[1].weight = nn.Parameter(torch.ones(2, 2))  # the latest assignment at a name counts
    assert sel.changed == ["'1.weight' was assigned a new Parameter"]
    m[1].weight = w1
    assert sel.changed == []
    m[1] = nn.Linear(2, 2)  # a submodule swapped in, then its parameters put back
    assert len(sel.changed) == 2
    m[1].weight, m[1].bias = w1, nn.Parameter(torch.zeros(2), requires_grad=False)
    assert sel.changed == [] and sel.frozen[-1][0] == "1.bias"  # a new frozen one is watched
    sel.unwatch()
