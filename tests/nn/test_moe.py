"""The MoE layer in one process: routing against a naive per-token reference, capacity dropping, the balancing
losses on hand-worked numbers and their gradients, expert bias, the step statistics, the optimizer hook that
finishes each step (on the optimizers holding MoE layers only, never process-wide) and bad input."""

import copy
import math
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import optimizer as torch_optimizer
from torch.overrides import TorchFunctionMode

import meshlight
from meshlight.nn import MoE, MoEConfig, attach_moe_updates, grouped_matmul


def reference(moe: MoE, x: Tensor, keep: Tensor = None) -> Tensor:
    """Every token through its chosen experts one at a time, weighted by its gate values."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens.float() @ moe.router.gate.weight.float().T
    scores = logits.softmax(-1) if moe.config.score == "softmax" else logits.sigmoid()
    chosen = (scores + moe.router.expert_bias).topk(moe.top_k, dim=-1).indices
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        gates = scores[t, chosen[t]]
        if moe.config.normalizes:
            gates = gates / gates.sum()
        for slot, e in enumerate(chosen[t].tolist()):
            if keep is not None and not keep[t, slot]:
                continue
            hidden = tokens[t] @ w1[e]
            hidden = F.silu(hidden) * (tokens[t] @ w3[e]) if w3 is not None else F.gelu(hidden, approximate="tanh")
            out[t] += gates[slot] * (hidden @ w2[e])
    return out.view(x.shape)


@pytest.mark.parametrize("options", [
    dict(top_k=2), dict(top_k=1), dict(top_k=2, activation="gelu"), dict(top_k=3, score="sigmoid"),
    dict(top_k=2, normalize_top_k=False), dict(top_k=1, grouped_mm=False),
], ids=["top2", "top1-switch", "gelu", "top3-sigmoid", "unnormalized", "loop"])
def test_routing_equals_a_per_token_reference(options):
    torch.manual_seed(0)
    moe = MoE(16, 32, 6, **options)
    moe.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, 6))  # the bias changes choices, not gate values
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(moe(x), reference(moe, x), rtol=1e-5, atol=1e-6)


def test_grouped_gemm_and_the_loop_agree_exactly_forward_and_backward():
    torch.manual_seed(0)
    x = torch.randn(20, 16, requires_grad=True)
    w = torch.randn(4, 16, 32, requires_grad=True)
    counts = torch.tensor([5, 0, 11, 4])
    outputs = []
    for grouped in (True, False):
        x.grad = w.grad = None
        y = grouped_matmul(x, w, counts, grouped)
        y.backward(torch.ones_like(y))
        outputs.append((y.detach(), x.grad.clone(), w.grad.clone()))
    for a, b in zip(*outputs):
        assert torch.equal(a, b)


def test_a_forward_issues_the_same_torch_calls_whatever_the_number_of_experts():
    # tokens sorted by expert with one argsort, each weight one grouped GEMM over every expert, results put back with
    # one index_copy: no Python loop over experts (torch's CPU grouped GEMM loops inside its kernel; CUDA's does not)
    class Calls(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    issued = {}
    for num_experts in (4, 64):
        torch.manual_seed(0)
        moe = MoE(16, 32, num_experts, top_k=2, capacity_factor=1.0)
        x = torch.randn(2, 24, 16)
        with Calls() as calls:
            out = moe(x)
        issued[num_experts] = calls.names
        keep = moe._capacity_mask(moe.router(x.reshape(-1, 16)), 24)
        torch.testing.assert_close(out, reference(moe, x, keep))
    assert issued[4] == issued[64]
    assert issued[4].count("_grouped_mm") == 3  # w1, w3, w2


def hand_picked_router(moe: MoE, preferences: list[list[float]]) -> Tensor:
    """Inputs whose router logits are exactly ``preferences`` (identity gate; dim = num_experts)."""
    with torch.no_grad():
        moe.router.gate.weight.copy_(torch.eye(moe.num_experts))
    return torch.tensor(preferences)


def test_capacity_drops_the_lowest_scores_of_each_sequence_and_expert():
    moe = MoE(4, 8, 4, top_k=1, capacity_factor=1.0, min_capacity=1)
    # One sequence of 8 tokens, capacity ceil(8·1/4 · 1.0) = 2 per expert. Expert 0 is wanted by tokens 0, 2, 5,
    # 6 with scores rising in the order 5 < 0 < 6 < 2: tokens 2 and 6 keep it. Expert 3 is wanted by 1 and 4.
    logits = [[2.0, 0, 0, 0], [0, 0, 0, 3.0], [4.0, 0, 0, 0], [0, 1.0, 0, 0],
              [0, 0, 0, 1.0], [1.0, 0, 0, 0], [3.0, 0, 0, 0], [0, 0, 2.0, 0]]
    x = hand_picked_router(moe, logits)
    assert moe.capacity(seq_len=8) == 2
    routing = moe.router(x)
    keep = moe._capacity_mask(routing, seq_len=8)
    assert keep.squeeze(1).tolist() == [False, True, True, True, True, False, True, True]
    out = moe(x)
    assert torch.all(out[[0, 5]] == 0)  # dropped: only the residual carries these tokens
    torch.testing.assert_close(out, reference(moe, x, keep))


def test_capacity_is_counted_per_sequence():
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, top_k=2, capacity_factor=0.5, min_capacity=1)
    x = torch.randn(4, 6, 8)
    whole = moe(x)
    for b in range(4):  # each sequence alone gives the same output: dropping never depends on the batch
        torch.testing.assert_close(moe(x[b:b + 1]), whole[b:b + 1])


def test_aux_and_z_losses_on_a_hand_worked_example():
    moe = MoE(2, 4, 2, top_k=1)
    # Both tokens prefer expert 0 with softmax [0.75, 0.25]: f = [1, 0], P = [0.75, 0.25],
    # aux = E·Σ f·P = 2 · 0.75 = 1.5; z = logsumexp([ln 3, 0])² = (ln 4)².
    x = hand_picked_router(moe, [[math.log(3), 0.0], [math.log(3), 0.0]])
    aux, z = moe._balance_losses(moe.router(x), seq_len=2)
    assert aux.item() == pytest.approx(1.5)
    assert z.item() == pytest.approx(math.log(4) ** 2)


def test_aux_loss_on_a_balanced_sigmoid_example_is_one():
    moe = MoE(2, 4, 2, top_k=1, score="sigmoid")
    # Token 0 picks expert 0, token 1 expert 1, with mirrored scores: f = P = [0.5, 0.5], aux = 2 · 0.5 = 1.
    x = hand_picked_router(moe, [[1.0, -1.0], [-1.0, 1.0]])
    aux, _ = moe._balance_losses(moe.router(x), seq_len=2)
    assert aux.item() == pytest.approx(1.0)


def test_global_balance_counts_the_whole_batch_and_per_sequence_balance_each_sequence():
    # Sequence 0: both tokens to expert 0; sequence 1: both to expert 1 — each sequence is all on one expert, the batch
    # is balanced. Scores [0.75, 0.25] and [0.25, 0.75]: P over the batch = [0.5, 0.5].
    logits = [[math.log(3), 0.0], [math.log(3), 0.0], [0.0, math.log(3)], [0.0, math.log(3)]]
    for balance, expected in (("global", 1.0), ("sequence", 1.5)):  # sequence: 2 · 0.75 in each
        moe = MoE(2, 4, 2, top_k=1, balance=balance)
        routing = moe.router(hand_picked_router(moe, logits))
        aux, _ = moe._balance_losses(routing, seq_len=2)
        assert aux.item() == pytest.approx(expected), balance


@pytest.mark.parametrize(("aux", "z"), [(0.1, 0.0), (0.0, 0.01), (0.1, 0.01)])
def test_balancing_losses_reach_the_router_as_if_added_to_the_loss(aux, z):
    torch.manual_seed(0)
    attached = MoE(8, 16, 4, top_k=2, aux_loss_coeff=aux, z_loss_coeff=z)
    plain = MoE(8, 16, 4, top_k=2, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    plain.load_state_dict(attached.state_dict())
    x = torch.randn(2, 6, 8)
    attached(x).square().sum().backward()
    routing = plain.router(x.reshape(-1, 8))
    aux_value, z_value = plain._balance_losses(routing, seq_len=6)
    (plain(x).square().sum() + aux * aux_value + z * z_value).backward()
    assert attached.router.gate.weight.grad.abs().sum() > 0
    torch.testing.assert_close(attached.router.gate.weight.grad, plain.router.gate.weight.grad)
    torch.testing.assert_close(attached.experts.w1.grad, plain.experts.w1.grad)


def test_aux_gradient_scale_scales_only_the_balancing_gradient():
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, top_k=2, aux_loss_coeff=0.1)
    x = torch.randn(2, 6, 8)
    grads = []
    for scale in (1.0, 0.5, 0.0):
        moe.zero_grad()
        moe.aux_gradient_scale = scale
        moe(x).sum().backward()
        grads.append(moe.router.gate.weight.grad.clone())
    torch.testing.assert_close(grads[1], (grads[0] + grads[2]) / 2)


def test_expert_bias_moves_against_the_load_before_each_optimizer_step_and_only_changes_choices():
    moe = MoE(4, 8, 4, top_k=1, expert_bias_rate=0.1, expert_bias_update="sign", aux_loss_coeff=0.0)
    optimizer = torch.optim.SGD(moe.parameters(), lr=0.0)
    attach_moe_updates(optimizer, moe)
    x = hand_picked_router(moe, [[1.0, 0, 0, 0]] * 3 + [[0, 1.0, 0, 0]])  # loads 3, 1, 0, 0; mean 1
    moe(x).sum().backward()
    optimizer.step()
    assert moe.router.expert_bias.tolist() == pytest.approx([-0.1, 0.0, 0.1, 0.1])
    assert moe.last_step.tokens.tolist() == [3.0, 1.0, 0.0, 0.0]
    # Scores softmax([0, 0.3, 0, 0.05]) = [.227, .307, .227, .239]: expert 1 wins unbiased, expert 3 (.339) biased.
    logits = torch.tensor([[0.0, 0.3, 0.0, 0.05]])
    routing = moe.router(logits)
    assert routing.experts.item() == 3
    assert routing.weights.item() == pytest.approx(logits.softmax(-1)[0, 3].item())  # the unbiased score


def test_proportional_expert_bias_moves_by_the_loads_error_relative_to_the_mean():
    moe = MoE(4, 8, 4, top_k=1, expert_bias_rate=0.1, aux_loss_coeff=0.0)  # proportional: the default
    optimizer = torch.optim.SGD(moe.parameters(), lr=0.0)
    attach_moe_updates(optimizer, moe)
    x = hand_picked_router(moe, [[1.0, 0, 0, 0]] * 5 + [[0, 1.0, 0, 0]] * 2 + [[0, 0, 1.0, 0]])  # 5, 2, 1, 0; mean 2
    moe(x).sum().backward()
    optimizer.step()
    # (mean − load) / mean = −1.5, 0, 0.5, 1: the idle expert moves by the whole rate, the even one not at all
    assert moe.router.expert_bias.tolist() == pytest.approx([-0.15, 0.0, 0.05, 0.1])


def test_step_statistics_cover_every_training_forward_of_a_step_and_reset():
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, top_k=2, capacity_factor=0.5, min_capacity=1)
    optimizer = torch.optim.SGD(moe.parameters(), lr=0.0)
    attach_moe_updates(optimizer, moe)
    for _ in range(3):  # e.g. accumulation micro-batches
        moe(torch.randn(2, 6, 8)).sum().backward()
    moe.eval()
    moe(torch.randn(2, 6, 8))  # evaluation is not counted
    moe.train()
    optimizer.step()
    load = moe.last_step
    assert load.tokens.sum().item() == 3 * 2 * 6 * 2
    assert 0 < load.dropped_fraction < 1 and load.aux_loss > 0 and load.z_loss > 0
    assert load.fraction.sum().item() == pytest.approx(1.0)
    assert moe._pending is None


class TwoMoEs(nn.Module):
    """A dense layer and two MoE layers, each fed its own input, so that every layer's routing is set by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 4)
        self.sign = MoE(4, 8, 4, top_k=1, expert_bias_rate=0.1, expert_bias_update="sign", aux_loss_coeff=0.0)
        self.proportional = MoE(4, 8, 4, top_k=1, expert_bias_rate=0.1, expert_bias_update="proportional",
                                aux_loss_coeff=0.0)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.dense(x).sum() + self.sign(x).sum() + self.proportional(y).sum()


def test_a_plain_loop_with_attach_moe_updates_moves_every_layers_bias_after_each_step():
    model = TwoMoEs()
    x = hand_picked_router(model.sign, [[1.0, 0, 0, 0]] * 3 + [[0, 1.0, 0, 0]])  # loads 3, 1, 0, 0
    y = hand_picked_router(model.proportional, [[1.0, 0, 0, 0]] * 5 + [[0, 1.0, 0, 0]] * 2 + [[0, 0, 1.0, 0]])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    updates = attach_moe_updates(optimizer, model)
    assert updates.layers == [model.sign, model.proportional]  # model order: the same all-reduces on every rank
    for step in (1, 2):
        for _ in range(2):  # two accumulated micro-batches: twice the tokens, the same relative loads
            model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        assert model.sign.last_step.tokens.tolist() == [6.0, 2.0, 0.0, 0.0]
        assert model.proportional.last_step.tokens.tolist() == [10.0, 4.0, 2.0, 0.0]
        # Sign: ±0.1 per step. Biased softmax scores of x's first rows, [.475, .175, .175, .175] + [-.1, 0, .1, .1]
        # after step 1, still pick expert 0. Proportional: (mean − load) / mean = −1.5, 0, 0.5, 1 of 0.1 per step;
        # y's first rows, [.475 − .15, .175, .175 + .05, .175 + .1] after step 1, still pick expert 0 too.
        assert model.sign.router.expert_bias.tolist() == pytest.approx([-0.1 * step, 0.0, 0.1 * step, 0.1 * step])
        assert model.proportional.router.expert_bias.tolist() == pytest.approx(
            [-0.15 * step, 0.0, 0.05 * step, 0.1 * step])
        assert model.sign._pending is None and model.proportional._pending is None


def test_only_the_layers_whose_parameters_the_optimizer_holds_are_finished_by_its_step():
    model = TwoMoEs()
    optimizer = torch.optim.SGD(model.sign.parameters(), lr=0.0)
    assert attach_moe_updates(optimizer, model).layers == [model.sign]
    with pytest.warns(UserWarning, match="no optimizer moves its expert bias"):  # model.proportional's
        model(torch.randn(4, 4), torch.randn(4, 4)).backward()
    optimizer.step()
    assert model.sign.last_step is not None and model.sign._pending is None
    assert model.proportional.last_step is None and model.proportional._pending is not None  # another optimizer's


def test_importing_meshlight_hooks_no_optimizer_and_dense_models_get_no_hook():
    hooks = {**torch_optimizer._global_optimizer_pre_hooks, **torch_optimizer._global_optimizer_post_hooks}
    assert meshlight and not [hook for hook in hooks.values() if hook.__module__.startswith("meshlight")]
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert attach_moe_updates(optimizer, model) is None
    assert not optimizer._optimizer_step_post_hooks and not optimizer._optimizer_step_pre_hooks
    moe = MoE(4, 8, 4)  # an MoE layer elsewhere is no reason to hook an optimizer that does not hold it
    assert attach_moe_updates(optimizer, nn.Sequential(model, moe)) is None
    assert not optimizer._optimizer_step_post_hooks


def test_attaching_twice_registers_one_hook_and_remove_takes_it_off():
    moe = MoE(4, 8, 4, top_k=1, expert_bias_rate=0.1, expert_bias_update="sign", aux_loss_coeff=0.0)
    optimizer = torch.optim.SGD(moe.parameters(), lr=0.0)
    updates = attach_moe_updates(optimizer, moe)
    assert attach_moe_updates(optimizer, nn.Sequential(moe)) is updates
    assert len(optimizer._optimizer_step_post_hooks) == 1 and updates.layers == [moe]
    x = hand_picked_router(moe, [[1.0, 0, 0, 0]] * 3 + [[0, 1.0, 0, 0]])
    moe(x).sum().backward()
    optimizer.step()
    assert moe.router.expert_bias.tolist() == pytest.approx([-0.1, 0.0, 0.1, 0.1])  # moved once, not twice
    updates.remove()
    assert not optimizer._optimizer_step_post_hooks
    with pytest.warns(UserWarning, match="no optimizer moves its expert bias"):
        moe(x).sum().backward()
    optimizer.step()
    assert moe.router.expert_bias.tolist() == pytest.approx([-0.1, 0.0, 0.1, 0.1])  # no hook, no move
    again = attach_moe_updates(optimizer, moe)
    assert again is not updates and len(optimizer._optimizer_step_post_hooks) == 1


def test_training_a_biased_layer_no_optimizer_updates_warns_once_naming_the_fix():
    moe = MoE(4, 8, 4, expert_bias_rate=0.1)
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match=r"no optimizer moves its expert bias: call "
                                         r"meshlight\.nn\.attach_moe_updates\(optimizer, model\)"):
        moe(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moe(x)  # once per layer
        attached = MoE(4, 8, 4, expert_bias_rate=0.1)
        optimizer = torch.optim.SGD(attached.parameters(), lr=0.1)
        attach_moe_updates(optimizer, attached)
        attached(x)  # attached: silent
        MoE(4, 8, 4, expert_bias_rate=0.0)(x)  # no bias to move: silent (last_step stays None until attached)
        with torch.no_grad():
            MoE(4, 8, 4, expert_bias_rate=0.1)(x)  # not training: silent
    del optimizer  # a layer whose optimizer is gone is not updated either
    with pytest.warns(UserWarning, match="no optimizer moves its expert bias"):
        attached(x)


def test_copies_and_pickles_of_a_layer_are_not_attached_to_its_optimizer():
    moe = MoE(4, 8, 4, expert_bias_rate=0.1)
    optimizer = torch.optim.SGD(moe.parameters(), lr=0.1)
    attach_moe_updates(optimizer, moe)
    for other in (pickle.loads(pickle.dumps(moe)), copy.deepcopy(moe)):
        assert other._updates is None and moe._updates is not None
        torch.testing.assert_close(other.state_dict(), moe.state_dict())


@pytest.mark.parametrize(("options", "message"), [
    (dict(num_experts=4, top_k=5), "top_k=5 must be between 1 and num_experts=4"),
    (dict(num_experts=4, top_k=0), "top_k=0 must be between 1 and num_experts=4"),
    (dict(num_experts=4, capacity_factor=0.0), "capacity_factor=0.0 must be > 0"),
    (dict(num_experts=4, capacity_factor=-1.0), "capacity_factor=-1.0 must be > 0"),
    (dict(num_experts=0), "num_experts=0 must be a positive integer"),
    (dict(num_experts=4, score="relu"), "score='relu'; choose 'softmax' or 'sigmoid'"),
    (dict(num_experts=4, aux_loss_coeff=-1.0), "aux_loss_coeff=-1.0 must be >= 0"),
    (dict(num_experts=4, expert_bias_update="linear"),
     "expert_bias_update='linear'; choose 'sign' (DeepSeek-V3) or 'proportional'"),
])
def test_bad_options_are_refused_when_the_layer_is_made(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MoEConfig(**options)
    num_experts, top_k = options.pop("num_experts"), options.pop("top_k", 2)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MoE(8, 16, num_experts, top_k, **options)


def test_grouped_mm_true_refuses_shapes_it_cannot_run():
    x, w = torch.randn(4, 6), torch.randn(2, 6, 10)  # rows of 24 and 40 bytes: not 16-byte aligned
    with pytest.raises(RuntimeError, match="grouped_mm=True, but torch._grouped_mm cannot run"):
        grouped_matmul(x, w, torch.tensor([2, 2]), grouped_mm=True)
