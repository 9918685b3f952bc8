"""Expert-parallel sizing (docs/parallel.md, "Sizing"): per-GPU memory of one EP layout and the smallest EP size that fits
a memory budget. Plain ints / bytes in (no engine or ModelArgs import), pure Python.

Per-GPU memory ~= replicated weights (attention, shared expert, embeddings, head, gates, ...: every rank holds them)
  + routed-expert bytes x (num_experts + redundant) / num_experts / EP
  + draft (DSpark) routed-expert bytes / EP
  + dispatch/combine buffers + activations of the largest step + KV / state (caller-supplied numbers).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from deepinfer_parallel.errors import ParallelConfigError

__all__ = [
    "EPMemoryEstimate",
    "dispatch_buffer_bytes",
    "estimate_gpu_memory",
    "expert_bytes",
    "resolve_num_redundant_experts",
    "smallest_ep_that_fits",
]

DEFAULT_EP_CANDIDATES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _nonneg(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise ParallelConfigError(f"{name}: expected a number >= 0, found {value!r}")


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ParallelConfigError(f"{name}: expected an int >= 1, found {value!r}")


def expert_bytes(
    *,
    num_layers: int,
    num_experts: int,
    hidden_size: int,
    moe_intermediate_size: int,
    weight_bits: int = 4,
    scale_block: int = 32,
    scale_bits: int = 8,
) -> int:
    """Bytes of the routed experts of `num_layers` MoE layers: each expert has w1, w3 `[inter, hidden]` and
    w2 `[hidden, inter]`, stored with `weight_bits` per value plus one `scale_bits` scale per `scale_block` values
    along the input dim (defaults: FP4 e2m1 + E8M0 per 32 = 0.5 + 1/32 bytes per parameter, docs/parallel.md, "Sizing").
    scale_block=0 means no scales."""
    for name, value in (("num_layers", num_layers), ("num_experts", num_experts), ("hidden_size", hidden_size),
                        ("moe_intermediate_size", moe_intermediate_size), ("weight_bits", weight_bits)):
        _positive_int(name, value)
    _nonneg("scale_block", scale_block)
    params = num_layers * num_experts * 3 * moe_intermediate_size * hidden_size
    bits = params * weight_bits
    if scale_block:
        if params % scale_block:
            raise ParallelConfigError(f"scale_block: expected a divisor of the expert sizes, found {scale_block}")
        bits += params // scale_block * scale_bits
    return bits // 8


def dispatch_buffer_bytes(
    *, max_tokens_per_rank: int, hidden_size: int, top_k: int, dispatch_bytes: float = 1.0, combine_bytes: float = 2.0
) -> int:
    """Dispatch + combine receive buffers for a dropless "expand" layout: one row per (token, expert) pair, so
    `max_tokens_per_rank x top_k` rows of `hidden_size` values each way (dispatch FP8 = 1 B, combine BF16 = 2 B by
    default). [I] our own estimate: the design only says the buffers are proportional to
    max tokens per rank x hidden x topk; DeepEP / Mega MoE sizes differ in constants and alignment."""
    for name, value in (("max_tokens_per_rank", max_tokens_per_rank), ("hidden_size", hidden_size), ("top_k", top_k)):
        _positive_int(name, value)
    _nonneg("dispatch_bytes", dispatch_bytes)
    _nonneg("combine_bytes", combine_bytes)
    return int(max_tokens_per_rank * top_k * hidden_size * (dispatch_bytes + combine_bytes))


def resolve_num_redundant_experts(*, num_experts: int, ep_size: int, min_redundant: int = 0) -> int:
    """The smallest redundant-slot count >= min_redundant with (num_experts + redundant) divisible by ep_size
    (docs/parallel.md, "EPLB": the requested extra experts are rounded up to fill every rank equally)."""
    _positive_int("num_experts", num_experts)
    _positive_int("ep_size", ep_size)
    if not isinstance(min_redundant, int) or min_redundant < 0:
        raise ParallelConfigError(f"min_redundant: expected an int >= 0, found {min_redundant!r}")
    return min_redundant + (-(num_experts + min_redundant)) % ep_size


@dataclass(frozen=True, kw_only=True)
class EPMemoryEstimate:
    """Per-GPU bytes of one EP layout, by item (all ints, bytes)."""

    ep_size: int
    num_redundant_experts: int
    replicated_bytes: int
    routed_expert_bytes: int  # this GPU's share of the main model's routed experts, incl. redundant copies
    draft_expert_bytes: int  # this GPU's share of the draft model's routed experts
    comm_buffer_bytes: int
    activation_bytes: int
    kv_state_bytes: int

    @property
    def weight_bytes(self) -> int:
        return self.replicated_bytes + self.routed_expert_bytes + self.draft_expert_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.comm_buffer_bytes + self.activation_bytes + self.kv_state_bytes


def estimate_gpu_memory(
    *,
    ep_size: int,
    replicated_bytes: int,
    routed_expert_bytes: int,
    num_experts: int,
    num_redundant_experts: int = 0,
    draft_expert_bytes: int = 0,
    comm_buffer_bytes: int = 0,
    activation_bytes: int = 0,
    kv_state_bytes: int = 0,
) -> EPMemoryEstimate:
    """Per-GPU memory of EP size `ep_size`.

    routed_expert_bytes: all routed experts of the main model (every layer, one copy each);
    num_experts: logical routed experts per layer (the redundant slots hold copies of this many experts' weights);
    draft_expert_bytes: all routed experts of the draft model (split evenly, no redundancy);
    the other byte counts are per GPU and added as given.
    (num_experts + num_redundant_experts) must be divisible by ep_size (see `resolve_num_redundant_experts`).
    """
    _positive_int("ep_size", ep_size)
    _positive_int("num_experts", num_experts)
    for name, value in (("replicated_bytes", replicated_bytes), ("routed_expert_bytes", routed_expert_bytes),
                        ("num_redundant_experts", num_redundant_experts), ("draft_expert_bytes", draft_expert_bytes),
                        ("comm_buffer_bytes", comm_buffer_bytes), ("activation_bytes", activation_bytes),
                        ("kv_state_bytes", kv_state_bytes)):
        _nonneg(name, value)
    slots = num_experts + num_redundant_experts
    if slots % ep_size:
        raise ParallelConfigError(
            f"num_redundant_experts: {num_experts} + {num_redundant_experts} = {slots} slots not divisible by "
            f"ep_size={ep_size}; use {resolve_num_redundant_experts(num_experts=num_experts, ep_size=ep_size, min_redundant=int(num_redundant_experts))}"
        )
    # Exact integer arithmetic: (bytes / experts) x slots / EP, rounded up (a GPU cannot hold a fraction of a byte).
    routed = -(-int(routed_expert_bytes) * slots // (num_experts * ep_size))
    draft = -(-int(draft_expert_bytes) // ep_size)
    return EPMemoryEstimate(
        ep_size=ep_size,
        num_redundant_experts=int(num_redundant_experts),
        replicated_bytes=int(replicated_bytes),
        routed_expert_bytes=routed,
        draft_expert_bytes=draft,
        comm_buffer_bytes=int(comm_buffer_bytes),
        activation_bytes=int(activation_bytes),
        kv_state_bytes=int(kv_state_bytes),
    )


def smallest_ep_that_fits(
    *,
    budget_bytes: int,
    replicated_bytes: int,
    routed_expert_bytes: int,
    num_experts: int,
    min_redundant_experts: int = 0,
    draft_expert_bytes: int = 0,
    comm_buffer_bytes: int = 0,
    activation_bytes: int = 0,
    kv_state_bytes: int = 0,
    min_free_bytes: int = 0,
    candidates: Iterable[int] = DEFAULT_EP_CANDIDATES,
) -> EPMemoryEstimate:
    """The estimate of the smallest EP size in `candidates` whose per-GPU total + min_free_bytes <= budget_bytes
    ("prefill uses the smallest EP that fits", docs/parallel.md "Sizing"). For each candidate the redundant slots are
    `resolve_num_redundant_experts(min_redundant=min_redundant_experts)`. Raises ParallelConfigError naming the
    largest candidate's requirement when none fits."""
    _nonneg("budget_bytes", budget_bytes)
    _nonneg("min_free_bytes", min_free_bytes)
    sizes = sorted(set(candidates))
    if not sizes:
        raise ParallelConfigError("candidates: expected at least one EP size, found none")
    estimate = None
    for ep in sizes:
        redundant = resolve_num_redundant_experts(num_experts=num_experts, ep_size=ep, min_redundant=min_redundant_experts)
        estimate = estimate_gpu_memory(
            ep_size=ep, replicated_bytes=replicated_bytes, routed_expert_bytes=routed_expert_bytes,
            num_experts=num_experts, num_redundant_experts=redundant, draft_expert_bytes=draft_expert_bytes,
            comm_buffer_bytes=comm_buffer_bytes, activation_bytes=activation_bytes, kv_state_bytes=kv_state_bytes,
        )
        if estimate.total_bytes + min_free_bytes <= budget_bytes:
            return estimate
    assert estimate is not None
    raise ParallelConfigError(
        f"budget_bytes: no EP size in {sizes} fits {budget_bytes / 1e9:.1f} GB per GPU; EP{estimate.ep_size} needs "
        f"{(estimate.total_bytes + min_free_bytes) / 1e9:.1f} GB (incl. min_free_bytes={min_free_bytes / 1e9:.1f} GB)"
    )
