"""What the layout planner plans for: a decoder-only transformer's shape (:class:`ModelSpec`) and a device's
memory, peak and links (:class:`Hardware`), with presets for published models (Llama 3, Mixtral, GPT-3,
Megatron-Core's weak-scaling GPTs) and common accelerators — the names ``meshlight plan --model/--gpu`` takes —
and the device a run has, found among them (:func:`detect_hardware`)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from meshlight.parallel.model_shape import ModelShape
from meshlight.parallel.rank_zero import rank_zero_warn

__all__ = ["GB", "HARDWARE", "MODELS", "Hardware", "ModelSpec", "detect_hardware", "preset_named"]


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer, as the planner needs it."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    seq_len: int
    swiglu: bool = True
    experts: int = 0
    top_k: int = 1
    moe_every: int = 1
    tie_embeddings: bool = False
    name: str = "model"
    rmsnorm: bool = True  # False: LayerNorm (what a norm keeps for backward differs)
    bias: bool = False  # biases in the blocks' Linears and LayerNorms (GPT-2 style; experts have none)
    positions: int = 0  # rows of a learned position embedding (0: rotary, or none)
    #: tensor parallelism's ``keep_gathered_inputs``: the projections' gathered inputs stay whole for backward
    keep_gathered_inputs: bool = False
    head_size: int = 0  # width of one attention head where it is not hidden / heads (Qwen3's 128 at hidden 2048)
    #: width of the dense MLP every token of an MoE layer runs beside its routed experts (a shared expert), 0: none
    shared_ffn: int = 0
    #: width of the MLP of an MoE model's layers without experts (DeepSeek's first ones, Llama 4 Maverick's every
    #: other one), 0: ``ffn_hidden``, the experts' width
    dense_ffn: int = 0
    #: MoE layers where a model places them otherwise than every ``moe_every``-th (after dense first layers), 0: that
    moe_count: int = 0
    #: the indices of the MoE layers where the model's structure tells them (:attr:`~meshlight.parallel.model_shape.
    #: ModelShape.moe_positions`); empty: as ``moe_every`` or ``moe_count`` place them (:meth:`moe_positions_of`)
    moe_positions: tuple[int, ...] = ()
    #: parameters of encoders beside the decoder (a multimodal model's vision tower and projector), held whole on
    #: every tensor-parallel rank of the first stage; their compute is not priced (it depends on the images)
    encoder_params: int = 0
    #: the fewest layers the first pipeline stage holds (Qwen3-VL's: those its encoder's features are added after,
    #: and the next), which bounds the stages: ``pp · virtual_stages ≤ layers − first_stage_layers + 1``, and may make
    #: the first rank the most loaded
    first_stage_layers: int = 1
    #: the share of the parameters that train (1: all); the others are frozen, as a LoRA fine-tune's model is beside its
    #: adapters: they keep no gradient and no optimizer state, and backward skips their weight-gradient matmuls
    trainable: float = 1.0

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def moe_layers(self) -> int:
        if self.experts and self._placed():
            return len(self.moe_positions)
        return min(self.moe_count or self.layers // self.moe_every, self.layers) if self.experts else 0

    def _placed(self) -> bool:
        """Whether ``moe_positions`` places the MoE layers: given, and within the layers (a shape changed to fewer
        layers falls back to ``moe_count``)."""
        return bool(self.moe_positions) and max(self.moe_positions) < self.layers

    def moe_positions_of(self) -> frozenset[int]:
        """The indices of the layers holding experts: as the structure told them, else the last ``moe_count`` (after
        dense first layers, as DeepSeek's), else every ``moe_every``-th (the ``moe_every``-1-th first, as meshlight's
        GPT and Llama 4 place them)."""
        if not self.experts:
            return frozenset()
        if self._placed():
            return frozenset(self.moe_positions)
        if self.moe_count:
            return frozenset(range(self.layers - self.moe_layers, self.layers))
        return frozenset(index for index in range(self.layers) if (index + 1) % self.moe_every == 0)

    @property
    def mlp_params(self) -> int:
        """One expert's parameters (one dense layer's MLP in a model without experts)."""
        return (3 if self.swiglu else 2) * self.hidden * self.ffn_hidden

    @property
    def dense_width(self) -> int:
        """The MLP width of the layers without experts."""
        return self.dense_ffn or self.ffn_hidden

    @property
    def attention_params(self) -> int:
        q = self.heads * self.head_dim
        return 2 * self.hidden * q + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def embedding_params(self) -> int:
        return (self.vocab + self.positions) * self.hidden

    @property
    def norm_params(self) -> int:
        return self.hidden * (2 if self.bias and not self.rmsnorm else 1)

    @property
    def head_params(self) -> int:
        return 0 if self.tie_embeddings else self.vocab * self.hidden

    @property
    def expert_params(self) -> int:
        return self.moe_layers * self.experts * self.mlp_params

    @property
    def shared_expert_params(self) -> int:
        """The shared experts' parameters in one MoE layer (dense: every token runs them)."""
        return (3 if self.swiglu else 2) * self.hidden * self.shared_ffn

    @property
    def block_params(self) -> int:
        """Dense (non-expert) parameters of all blocks: attention, norms, dense MLPs, routers and shared experts."""
        return self.blocks_params(self.layers, self.moe_layers)

    def blocks_params(self, blocks: float, moe: float) -> float:
        """Dense (non-expert) parameters of ``blocks`` blocks, ``moe`` of them holding experts: attention and norms
        in each, a dense MLP in the others, a router and shared experts in those."""
        kv = self.kv_heads * self.head_dim
        attention = self.attention_params + (self.heads * self.head_dim + 2 * kv + self.hidden if self.bias else 0)
        mlp = (3 if self.swiglu else 2) * self.hidden * self.dense_width + (
            (2 if self.swiglu else 1) * self.dense_width + self.hidden if self.bias else 0)
        return blocks * (attention + 2 * self.norm_params) + (blocks - moe) * mlp + moe * (
            self.hidden * self.experts + self.shared_expert_params)

    @property
    def params(self) -> int:
        return (self.block_params + self.expert_params + self.embedding_params + self.head_params + self.norm_params
                + self.encoder_params)

    @property
    def active_params(self) -> int:
        """Non-embedding parameters one token of the decoder uses (``top_k`` of the experts; an encoder's aside)."""
        routed = self.moe_layers * self.top_k * self.mlp_params
        return self.params - self.embedding_params - self.expert_params - self.encoder_params + routed

    def activation_values_per_token(self, tp: int, moe_share: Optional[float] = None) -> float:
        """Values one block's backward keeps per token (no recomputation), as autograd saves them in meshlight's
        blocks under tensor and sequence parallelism (measured by saved-tensor hooks, in the tests), all split
        over tp: the inputs of the q/k/v and first MLP projections, kept as this rank's share of the sequence and
        gathered again in backward (2·h, as Megatron-LM); each norm's input and, for RMSNorm, its normalized
        output (4·h, LayerNorm 2·h); q and the attention output (2·h), k and v (2·kv); and the MLP's hidden
        values — GELU's input and output (2·ffn), SwiGLU's two projections, their product's factors and the
        product (4·ffn); ``top_k`` of them in a MoE layer, beside each routed token's copy and its expert's
        output (2·top_k·h), and a shared expert's (4·shared_ffn; MoE layers are estimated, not measured). Flash
        attention keeps no score matrix; no dropout. With ``keep_gathered_inputs`` the projections' inputs stay
        whole: 2·h, whatever tp. ``moe_share``: of blocks of which that share hold experts (default: the model's)."""
        kv = self.kv_heads * self.head_dim
        per_width = 4 if self.swiglu else 2
        moe_share = self.moe_layers / self.layers if moe_share is None else moe_share
        routed = (per_width * self.ffn_hidden + 2 * self.hidden) * self.top_k + per_width * self.shared_ffn
        mlp = per_width * self.dense_width * (1 - moe_share) + routed * moe_share
        norms = (4 if self.rmsnorm else 2) * self.hidden
        gathered = 2 * self.hidden * (1 - 1 / tp) if self.keep_gathered_inputs else 0.0
        return (norms + 4 * self.hidden + 2 * kv + mlp) / tp + gathered

    def flops_per_token(self) -> float:
        """Training FLOPs per token, the PaLM/torchtitan MFU convention (as :meth:`GPT.flops_per_token`)."""
        return 6 * self.active_params + 12 * self.layers * self.heads * self.head_dim * self.seq_len

    def layer_flops_per_token(self, moe_share: float) -> float:
        """Training FLOPs per token of one block, of blocks of which ``moe_share`` hold experts
        (:meth:`flops_per_token`'s convention)."""
        active = self.blocks_params(1, moe_share) + moe_share * self.top_k * self.mlp_params
        return 6 * active + 12 * self.heads * self.head_dim * self.seq_len

    def executed_flops_per_token(self) -> float:
        """What a training step computes per token: :meth:`flops_per_token`, whose convention leaves out a head tied
        to the token embedding (its weight is the embedding's), plus that head's matmul, which runs all the same;
        less the weight-gradient matmuls of frozen parameters (a third of a matmul's forward and backward)."""
        tied = self.head_flops_per_token() if self.tie_embeddings else 0
        return self.flops_per_token() + tied - (1 - self.trainable) * (2 * self.active_params + tied / 3)

    def head_flops_per_token(self) -> float:
        """The LM head's matmul, forward and backward, tied to the token embedding or not."""
        return 6 * self.vocab * self.hidden

    def recompute_flops_per_token(self) -> float:
        """The blocks' forward again, with full activation recomputation (the LM head is not recomputed)."""
        return 2 * (self.active_params - self.head_params) + 4 * self.layers * self.heads * self.head_dim * self.seq_len

    @classmethod
    def from_gpt_config(cls, config: Any, seq_len: Optional[int] = None) -> ModelSpec:
        moe = config.moe
        return cls(layers=config.n_layers, hidden=config.dim, heads=config.n_heads, kv_heads=config.kv_heads,
                   ffn_hidden=config.ffn_dim, vocab=config.vocab_size, seq_len=seq_len or config.max_seq_len,
                   swiglu=config.mlp == "swiglu", experts=moe.num_experts if moe else 0,
                   top_k=moe.top_k if moe else 1, moe_every=config.moe_every, tie_embeddings=config.tie_embeddings,
                   name="GPT", rmsnorm=config.norm == "rmsnorm", bias=config.bias,
                   positions=config.max_seq_len if config.positions == "learned" else 0)

    @classmethod
    def from_shape(cls, shape: ModelShape, seq_len: Optional[int] = None, name: str = "model") -> ModelSpec:
        """The planner's view of a shape read from a model's structure (:func:`~meshlight.parallel.model_shape.
        model_shape`); heads 64 wide where no attention names its head count or ``head_dim``, SwiGLU where the
        structure does not show the MLP's projections."""
        heads = shape.heads or max(shape.hidden // 64, 1)
        return cls(layers=shape.blocks, hidden=shape.hidden, heads=heads, kv_heads=shape.kv_heads or heads,
                   ffn_hidden=shape.mlp_width, vocab=shape.vocab, seq_len=seq_len or 2048, experts=shape.experts,
                   top_k=shape.top_k, moe_count=shape.moe_layers, moe_positions=shape.moe_positions,
                   dense_ffn=shape.dense_mlp_width,
                   tie_embeddings=shape.tied_head, swiglu=shape.gated_mlp is not False, name=name,
                   head_size=shape.head_dim if shape.head_dim and shape.head_dim * heads != shape.hidden else 0,
                   shared_ffn=shape.shared_mlp_width, encoder_params=shape.encoder_params,
                   first_stage_layers=shape.first_stage_blocks)

    def replace(self, **changes: Any) -> ModelSpec:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Hardware:
    """One kind of device and the links between them; and what a run keeps in its memory per value (the
    precision; what the ``Offload`` callback moves to host memory instead)."""

    name: str
    memory: float  # bytes per device
    peak_flops: float  # dense bf16 (fp32 on CPU) FLOP/s per device
    intra_bandwidth: float  # bytes/s one device sends within a node (NVLink)
    inter_bandwidth: float  # bytes/s one device sends to other nodes (its NIC)
    devices_per_node: int = 8
    param_bytes: int = 2  # compute copy (bf16); 4 = fp32 training (at fit start: the run's precision)
    activation_bytes: float = 2  # per value autograd saves (autocast: about 2.7)
    state_bytes: int = 4  # per value of the master copy, gradients and Adam's moments (16-bit "true" precision: 2)
    offload_optimizer: bool = False  # master shards, their gradients and the optimizer's state in host memory
    offload_activations: float = 0.0  # share of the blocks whose saved activations wait in host memory
    # share of the blocks whose saved activations ActivationCompression keeps in fewer bytes, and those bytes per value
    compressed_activations: float = 0.0
    compressed_activation_bytes: float = 2.0
    # bytes the data-parallel gradient reductions move over uncompressed (grad_compression: bf16 of fp32 gradients
    # 0.5; GradientCompression.ratio())
    gradient_compression: float = 1.0
    host_memory: float = 256e9  # bytes of host memory per device, for what is offloaded (2 TB over 8 devices)
    host_bandwidth: float = 0.85 * 64e9  # bytes/s each way between the device and host memory (PCIe 5 x16)
    host_step_rate: float = 0.78e9  # parameters/s one host thread's optimizer step reaches (optimizer offload)
    # threads each device's process steps its optimizer with (None: at fit the run's own, on the command line 1)
    host_threads: Optional[int] = None
    host_memory_bandwidth: float = 0.75 * 2 * 8 * 38.4e9  # bytes/s of the node's host memory its host steps share
    fp32_flops: Optional[float] = None  # dense FLOP/s of fp32 matmuls off the tensor cores (None: peak_flops)
    tf32_flops: Optional[float] = None  # ... of fp32 matmuls as TF32 on the tensor cores (None: fp32_flops)
    float32_matmul_precision: str = "highest"  # the run's torch.get_float32_matmul_precision(): high/medium = TF32
    latency: float = 2e-5  # seconds per collective, p2p message or pipeline action, whatever its size
    # and per step of a ring collective, within a node and between nodes (NCCL's ring/Simple figures)
    hop_latency_intra: float = 3.4e-6
    hop_latency_inter: float = 9.6e-6
    # bytes/s of device memory (HBM), at which the kernels between the matmuls stream activations (inf: not priced)
    memory_bandwidth: float = math.inf

    def __post_init__(self) -> None:
        rates = ("memory", "peak_flops", "intra_bandwidth", "inter_bandwidth", "host_memory", "host_bandwidth",
                 "host_step_rate", "host_memory_bandwidth", "memory_bandwidth")
        bad = [f"{name}={getattr(self, name)!r}" for name in rates if not getattr(self, name) > 0]
        bad += [f"{name}={getattr(self, name)!r}" for name in ("devices_per_node", "host_threads")
                if getattr(self, name) is not None and not getattr(self, name) >= 1]
        if bad:
            raise ValueError(f"Hardware {self.name!r}: {', '.join(bad)}: give values > 0.")

    def replace(self, **changes: Any) -> Hardware:
        return dataclasses.replace(self, **changes)

    def host_steps_per_second(self, world: int) -> float:
        """Parameters/s the host's optimizer steps for each device under optimizer offload: its threads' rate, up
        to the device's share of the node's host memory bandwidth — Adam(W) reads the master copy, the gradient and
        two moments and writes three of them back, 7 values per parameter, and the devices of a node (those of a
        ``world`` smaller than one node: all of them) step at once."""
        sharing = min(self.devices_per_node, world)
        return min((self.host_threads or 1) * self.host_step_rate,
                   self.host_memory_bandwidth / sharing / (7 * self.state_bytes))

    @property
    def compute_flops(self) -> float:
        """Dense FLOP/s the run's matmuls peak at: the device's 16-bit peak, but where activations are fp32 (an
        fp32 run) what torch's float32 matmul precision gives — its default "highest" keeps fp32 off the tensor
        cores (an H100's 67 TFLOP/s, a fifteenth of bf16), "high" and "medium" run TF32 at half the bf16 rate."""
        if self.activation_bytes < 4:
            return self.peak_flops
        fp32 = self.fp32_flops or self.peak_flops
        return fp32 if self.float32_matmul_precision == "highest" else self.tf32_flops or fp32


GB = 1e9
#: Host memory: 2 TB per 8-device node for every preset (DGX A100 80GB, DGX H100/H200, the base DGX B200; MI300X
#: servers vary) — ``meshlight plan --host-memory`` for other nodes; at fit, the machine's own.
#: Host link: 85% (what pinned copies reach) of a PCIe x16 link's rate each way — 64 GB/s for PCIe 5 (H100, H200,
#: B200, MI300X), 32 GB/s for PCIe 4 (A100); ``benchmarks/planner.py`` sets the estimate beside one H100's
#: measured activation offload. ``meshlight plan --host-bandwidth`` for other links.
#: Device memory bandwidth (datasheets): H100 SXM 3.35, H200 4.8, H100 PCIe 2.0, H100 NVL 3.9, H200 NVL 4.8, A100
#: SXM 80GB 2.039, A100 PCIe 80GB 1.935, B200 8, MI300X 5.3 TB/s; torchtitan's 96 GB HBM2e H100s 2.4 (its benchmark
#: page). The CPU preset leaves it unpriced: its gloo processes' step is dominated by their matmuls and latencies.
#: fp32 matmuls (datasheets, dense): off the tensor cores H100/H200 67, A100 19.5, B200 75, MI300X 163.4 TFLOP/s;
#: as TF32 half the bf16 peak on each.
#: PCIe cards (H100 PCIe, H100 and H200 NVL, A100 PCIe): their datasheets' dense peaks (H100 PCIe 756 bf16 / 51 fp32,
#: NVL 835 / 60 TFLOP/s); the devices of a node reach each other over PCIe (NVLink bridges join pairs only, which the
#: one intra-node rate cannot tell), at the host link's rate.
#: Host step: one host thread's fused AdamW, 0.78e9 parameters/s (``benchmarks/host_step.py --params 400000000
#: --optimizers AdamW`` on the host of the H100 machine ``benchmarks/gpu.py`` ran on: 0.784e9 on one thread, 4.38e9
#: on its 16), on one thread per device by default (torchrun's ``OMP_NUM_THREADS=1``; at fit, the run's own
#: count). More threads step faster until the node's host memory bandwidth binds: 75% of two sockets of eight
#: channels, DDR5-4800 by default (461 GB/s, a DGX H100's), DDR4-3200 for A100 nodes (307 GB/s, a DGX A100's); the
#: H100 machine's 16 cores reached 123 GB/s. ``meshlight plan --host-step-rate``, ``--host-threads`` and
#: ``--host-memory-bandwidth`` for other hosts.
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("NVIDIA H100 SXM 80GB", 80 * GB, 989e12, 450 * GB, 50 * GB, fp32_flops=67e12,
                     tf32_flops=989e12 / 2, memory_bandwidth=3.35e12),
    "h200": Hardware("NVIDIA H200 SXM 141GB", 141 * GB, 989e12, 450 * GB, 50 * GB, fp32_flops=67e12,
                     tf32_flops=989e12 / 2, memory_bandwidth=4.8e12),
    "h100-pcie": Hardware("NVIDIA H100 PCIe 80GB", 80 * GB, 756e12, 0.85 * 64 * GB, 50 * GB, fp32_flops=51e12,
                          tf32_flops=756e12 / 2, memory_bandwidth=2e12),
    "h100-nvl": Hardware("NVIDIA H100 NVL 94GB", 94 * GB, 835e12, 0.85 * 64 * GB, 50 * GB, fp32_flops=60e12,
                         tf32_flops=835e12 / 2, memory_bandwidth=3.9e12),
    "h200-nvl": Hardware("NVIDIA H200 NVL 141GB", 141 * GB, 835e12, 0.85 * 64 * GB, 50 * GB, fp32_flops=60e12,
                         tf32_flops=835e12 / 2, memory_bandwidth=4.8e12),
    "a100": Hardware("NVIDIA A100 SXM 80GB", 80 * GB, 312e12, 300 * GB, 25 * GB, host_bandwidth=0.85 * 32 * GB,
                     host_memory_bandwidth=0.75 * 2 * 8 * 25.6 * GB, fp32_flops=19.5e12, tf32_flops=312e12 / 2,
                     memory_bandwidth=2.039e12),
    "a100-pcie": Hardware("NVIDIA A100 PCIe 80GB", 80 * GB, 312e12, 0.85 * 32 * GB, 25 * GB,
                          host_bandwidth=0.85 * 32 * GB, host_memory_bandwidth=0.75 * 2 * 8 * 25.6 * GB,
                          fp32_flops=19.5e12, tf32_flops=312e12 / 2, memory_bandwidth=1.935e12),
    "b200": Hardware("NVIDIA B200 192GB", 192 * GB, 2250e12, 900 * GB, 50 * GB, fp32_flops=75e12,
                     tf32_flops=2250e12 / 2, memory_bandwidth=8e12),
    "mi300x": Hardware("AMD MI300X 192GB", 192 * GB, 1307e12, 448 * GB, 50 * GB, fp32_flops=163.4e12,
                       tf32_flops=1307e12 / 2, memory_bandwidth=5.3e12),
    # torchtitan's published Llama 3 runs: H100 with 96 GB HBM2e (2.4 TB/s) capped at 500 W (peaks scaled by power)
    "h100-96gb-500w": Hardware("NVIDIA H100 96GB HBM2e, 500 W cap", 96 * GB, 989e12 * 500 / 700, 450 * GB, 50 * GB,
                               fp32_flops=67e12 * 500 / 700, tf32_flops=989e12 / 2 * 500 / 700,
                               memory_bandwidth=2.4e12),
    # gloo processes on one host: one latency per collective, whatever the group (NCCL's hops do not apply); what
    # offload "moves" is already in host memory, and the step is the one the model leaves out without offload
    "cpu": Hardware("CPU process (gloo)", 4 * GB, 50e9, 2 * GB, 1 * GB, devices_per_node=64, param_bytes=4,
                    host_bandwidth=math.inf, host_step_rate=math.inf, host_memory_bandwidth=math.inf,
                    activation_bytes=4, latency=2e-3, hop_latency_intra=0.0, hop_latency_inter=0.0),
}


def _llama(layers: int, hidden: int, heads: int, kv: int, ffn: int, name: str) -> ModelSpec:
    return ModelSpec(layers, hidden, heads, kv, ffn, vocab=128256, seq_len=8192, name=name)


def _megatron(layers: int, hidden: int, heads: int, name: str) -> ModelSpec:
    return ModelSpec(layers, hidden, heads, heads, 4 * hidden, vocab=131072, seq_len=4096, swiglu=False, name=name,
                     rmsnorm=False)


MODELS: dict[str, ModelSpec] = {
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, "Llama 3 8B"),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672, "Llama 3 70B"),
    "llama3-405b": _llama(126, 16384, 128, 8, 53248, "Llama 3.1 405B"),
    "mixtral-8x7b": ModelSpec(32, 4096, 32, 8, 14336, vocab=32000, seq_len=4096, experts=8, top_k=2,
                              name="Mixtral 8x7B"),
    # Llama 4 (its Hugging Face configs): one routed expert of 16 (128) per token beside a shared one in every
    # (every other) layer, Maverick's other layers dense and twice as wide; 109B (400B) parameters, 17B active
    "llama4-scout": ModelSpec(48, 5120, 40, 8, 8192, vocab=202048, seq_len=8192, experts=16, top_k=1,
                              shared_ffn=8192, head_size=128, name="Llama 4 Scout"),
    "llama4-maverick": ModelSpec(48, 5120, 40, 8, 8192, vocab=202048, seq_len=8192, experts=128, top_k=1,
                                 moe_every=2, shared_ffn=8192, dense_ffn=16384, head_size=128,
                                 name="Llama 4 Maverick"),
    "gpt3-175b": ModelSpec(96, 12288, 96, 96, 4 * 12288, vocab=50257, seq_len=2048, swiglu=False, name="GPT-3 175B",
                           rmsnorm=False),
    # Megatron-Core's weak-scaling models (GPT, vocabulary 131,072, sequence 4,096)
    "megatron-1.7b": _megatron(24, 2048, 16, "Megatron 1.7B"),
    "megatron-7.1b": _megatron(30, 4096, 32, "Megatron 7.1B"),
    "megatron-16b": _megatron(32, 6144, 48, "Megatron 16B"),
    "megatron-32b": _megatron(48, 7168, 56, "Megatron 32B"),
    "megatron-70b": _megatron(84, 8192, 64, "Megatron 70B"),
    "megatron-119b": _megatron(92, 10240, 80, "Megatron 119B"),
    "megatron-177b": _megatron(96, 12288, 96, "Megatron 177B"),
    "megatron-314b": _megatron(96, 16384, 128, "Megatron 314B"),
    "megatron-462b": _megatron(112, 18432, 144, "Megatron 462B"),
}


def preset_named(device_name: str) -> Optional[Hardware]:
    """The device preset whose key is in ``device_name`` ("NVIDIA H100 80GB HBM3": ``h100``; "NVIDIA H100 PCIe":
    ``h100-pcie``; "NVIDIA A100-PCIE-40GB": ``a100-pcie``), or None."""
    name = device_name.lower()
    kind = next((k for k in ("h200", "h100", "a100", "b200", "mi300x") if k in name), None)
    card = next((c for c in ("pcie", "nvl") if c in name), None)
    return HARDWARE.get(f"{kind}-{card}", HARDWARE[kind]) if kind else None


def detect_hardware(device: torch.device, processes_per_node: int) -> Hardware:
    """The preset matching ``device`` (CUDA by name, its memory as reported, and the process's float32 matmul
    precision), or the CPU preset; either with this node's host memory shared by its processes (a CPU process's
    memory is the host's). A CUDA device without a preset gets generic figures, with a warning that says how to
    give its own."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(processes_per_node, 1)
    except (ValueError, OSError, AttributeError):
        host = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        preset = preset_named(props.name)
        if preset is None:
            preset = Hardware(props.name, props.total_memory, 100e12, 100 * GB, 25 * GB)
            rank_zero_warn(
                f"meshlight has no figures for the device {props.name!r}: the planner and TrainingMonitor's MFU assume"
                f" {preset.peak_flops / 1e12:g} TFLOP/s for its matmuls (16-bit and fp32 alike),"
                f" {preset.intra_bandwidth / GB:g} GB/s between the devices of a node and"
                f" {preset.inter_bandwidth / GB:g} GB/s between nodes. Give its own: Hybrid3DStrategy(hardware="
                f"meshlight.parallel.planner.Hardware(name, memory, peak_flops, intra_bandwidth, inter_bandwidth,"
                f" fp32_flops=...)) and TrainingMonitor(peak_flops=...).")
        return preset.replace(memory=float(props.total_memory), devices_per_node=processes_per_node,
                              host_memory=float(host or preset.host_memory),
                              float32_matmul_precision=torch.get_float32_matmul_precision())
    memory = float(host or HARDWARE["cpu"].memory)
    return HARDWARE["cpu"].replace(memory=memory, host_memory=memory, devices_per_node=processes_per_node)
