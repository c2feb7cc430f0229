"""torchrun worker (2 processes): a column-parallel group's input kept as this rank's share and gathered again in
backward, against keeping it gathered — alone, under recomputation, under outer saved-tensor hooks and through
two backwards of one graph; and a sequence mixer kept whole on every rank, against one process."""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from meshlight.models import GPT, GPTConfig
from meshlight.parallel import CollectiveTraffic
from meshlight.parallel.blocks import BlockSelection
from meshlight.parallel.recompute import apply_recompute
from meshlight.parallel.tensor import apply_tensor_parallel
from meshlight.parallel.tensor_plan import model_plan

CONFIG = GPTConfig(vocab_size=64, max_seq_len=16, n_layers=2, n_heads=4, n_kv_heads=2, dim=32, mlp="swiglu",
                   positions="rotary", bias=False)
BATCH = 2
MODES = ("plain", "recompute", "outer hooks", "two backwards")


class CountingHooks(torch.autograd.graph.saved_tensors_hooks):
    """Outer saved-tensor hooks that count the values they are given to keep."""

    def __init__(self) -> None:
        self.values = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self.values += tensor.numel()
            return tensor.detach()

        super().__init__(pack, lambda tensor: tensor)


def run(keep: bool, mode: str) -> dict:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), model_plan(model), keep_gathered_inputs=keep)
    if mode == "recompute":
        apply_recompute(model, BlockSelection())
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.max_seq_len), generator=generator)
    outer = CountingHooks()
    with loss_parallel():
        if mode == "outer hooks":
            with outer:
                logits = model(tokens)
        else:
            logits = model(tokens)
        hooks_left = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        traffic = CollectiveTraffic()
        with traffic:
            loss.backward(retain_graph=mode == "two backwards")
            if mode == "two backwards":
                loss.backward()
    grads = {name: p.grad.to_local().clone() for name, p in model.named_parameters()}
    return {"grads": grads, "backward_all_gathers": traffic.summary().get("all_gather", {}).get("calls", 0),
            "outer_values": outer.values, "hooks_left": hooks_left}


def no_hooks_left_after_a_failed_forward() -> bool:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), model_plan(model))

    def fail(*_: object) -> None:
        raise RuntimeError("stop")

    model.blocks[0].attn.wo.register_forward_pre_hook(fail)
    try:
        model(torch.zeros(BATCH, CONFIG.max_seq_len, dtype=torch.long))
    except RuntimeError:
        pass
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


class Float32Mixer(torch.nn.Module):
    """A float64 sequence mixer with a float32 part, as linear attentions' kernels have: a running sum over the
    sequence computed in float32 (its gradient a sum over the later positions, rounded in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(CONFIG.dim, CONFIG.dim, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).float().cumsum(1).double()


def whole_mixer() -> list[dict]:
    """The mixer whole on each of 2 ranks (``WholeMixer``: each given its half of the sequence) against one process:
    each rank's gradients, its input's share and the weights' (summed over the ranks), exactly one process's."""
    from torch.distributed.tensor.parallel import parallelize_module

    from meshlight.parallel.tensor import reduce_partial_gradients
    from meshlight.parallel.tensor_styles import WholeMixer

    torch.manual_seed(0)
    one = Float32Mixer()
    x = torch.randn(BATCH, CONFIG.max_seq_len, CONFIG.dim, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(BATCH, CONFIG.max_seq_len, CONFIG.dim, dtype=torch.float64)
    (one(x) * weights).sum().backward()
    mixer = Float32Mixer()
    mixer.load_state_dict(one.state_dict())
    parallelize_module(mixer, init_device_mesh("cpu", (2,)), WholeMixer())
    length, rank = CONFIG.max_seq_len // 2, dist.get_rank()
    share = x.detach()[:, rank * length:(rank + 1) * length].clone().requires_grad_()
    (mixer(share) * weights[:, rank * length:(rank + 1) * length]).sum().backward()
    reduce_partial_gradients(mixer.parameters())
    mine = {"input": (share.grad, x.grad[:, rank * length:(rank + 1) * length]),
            **{name: (p.grad.full_tensor(), dict(one.named_parameters())[name].grad)
               for name, p in mixer.named_parameters()}}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {name: torch.equal(*pair) for name, pair in mine.items()})
    return gathered


if __name__ == "__main__":
    out = sys.argv[1]
    results = {(keep, mode): run(keep, mode) for keep in (True, False) for mode in MODES}
    results["clean after failure"] = no_hooks_left_after_a_failed_forward()
    results["whole mixer"] = whole_mixer()
    if dist.get_rank() == 0:
        torch.save(results, out)
