"""Which kernels one stage of :class:`~.model.TabICLv2` runs: one frozen object per stage.

A served model (:class:`~..serving.served.ServedTabICL`) hands each stage module (column embedding, row
interaction, in-context learning) one :class:`StageKernels` when it is built
(:func:`use_stage_kernels`), and every module of the stage that has a kernel choice reads it from
there. The object is frozen: a served model's kernel choices do not change after construction, so
compiled graphs (which guard on them) stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: ``torch.nn.attention.SDPBackend`` members by the names the serving options use.
SDPA_BACKENDS = {
    "math": "MATH",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
}
#: tabserve's own attention kernels by the names the serving options use: ``head16`` is
#: :func:`tabserve.ops.small_head_attention` (CUDA, fp16 / bf16, head dimension 16: the column
#: and row stages, padded or not); ``head16-short`` the same kernel only where every key fits its
#: one staged chunk (<= :data:`SHORT_KEYS` keys: the column stage's rows over the 128
#: induced tokens), longer key runs on PyTorch's SDPA; ``flash-half`` / ``flash-fp8``:
#: :func:`tabserve.ops.flash_attention` on half or fp8 operands for the stage's unpadded calls
#: (padded calls keep ``prefix_attention``); ``head16-flash``: ``head16-short`` with the longer
#: unpadded key runs (the column stage's inducing points over the train rows) on ``flash-half``.
#: Where a kernel does not apply, the stage runs PyTorch's SDPA.
KERNEL_BACKENDS = ("head16", "head16-short", "head16-flash", "flash-half", "flash-fp8")
ATTENTION_BACKENDS = (*SDPA_BACKENDS, *KERNEL_BACKENDS)
_SMALL_HEAD_BACKENDS = ("head16", "head16-short", "head16-flash")
_SHORT_KEY_BACKENDS = ("head16-short", "head16-flash")
#: Operand kind of :func:`tabserve.ops.flash_attention` per backend (True: fp8).
_FLASH_OPERANDS = {"flash-half": False, "flash-fp8": True, "head16-flash": False}
#: The backends that run tabserve's Triton flash kernel.
FLASH_BACKENDS = tuple(_FLASH_OPERANDS)
#: ``prefix_attention`` kernel of padded attention per backend: flash / efficient have varlen
#: kernels reading n on the device; cuDNN and math run SDPA with a key mask (``masked``).
_PREFIX_BACKENDS = {"flash": "flash", "efficient": "efficient", "cudnn": "masked", "math": "masked"}
#: Keys :func:`tabserve.ops.small_head_attention` stages in one chunk (its fastest path; the
#: ``head16-short`` and ``head16-flash`` backends' limit).
SHORT_KEYS = 128
#: The model's stages in the order data flows through them (``stage -> submodule``).
STAGES = {"col": "col_embedder", "row": "row_interactor", "icl": "icl_predictor"}


@dataclass(frozen=True)
class StageKernels:
    """The kernel choices of one stage (the serving options' fields of the same names).

    Fields:
        attention: the stage's attention backend (:data:`ATTENTION_BACKENDS`), None for
            PyTorch's own choice.
        fused_ffn: each block's feed-forward half through :func:`tabserve.ops.feed_forward`
            where its kernel applies (CUDA under fp16 / bf16 autocast, width <= 128).
        fused_norm_linear: each block's LayerNorm 1 and input projections through
            :func:`tabserve.ops.norm_linear` where its kernel applies.
        rope_in_projection: RoPE of queries and keys inside that fused projection.
        fused_out_projection: the attention's out-projection folded into the fused
            feed-forward (its ``update_weight``).
        fused_row_tokens: the row stage's tokens written by the column stage's last fused
            feed-forward, CLS tokens first (read by the row stage module).
        icl_one_pass: the ICL stage's unpadded forward takes train and test rows through each
            block in one pass.
    """

    attention: str | None = None
    fused_ffn: bool = False
    fused_norm_linear: bool = False
    rope_in_projection: bool = False
    fused_out_projection: bool = False
    fused_row_tokens: bool = False
    icl_one_pass: bool = False

    def __post_init__(self):
        if self.attention is not None and self.attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"StageKernels: attention must be one of {ATTENTION_BACKENDS} or None, got "
                f"{self.attention!r}"
            )

    @property
    def prefix_backend(self) -> str:
        """``tabserve.ops.prefix_attention``'s backend for the stage's padded attention."""
        return _PREFIX_BACKENDS.get(self.attention, "auto")

    @property
    def small_heads(self) -> bool:
        """Whether attention runs on :func:`tabserve.ops.small_head_attention` where it applies."""
        return self.attention in _SMALL_HEAD_BACKENDS

    @property
    def small_head_max_keys(self) -> int | None:
        """With :attr:`small_heads`: the most keys the kernel takes (None: any number)."""
        return SHORT_KEYS if self.attention in _SHORT_KEY_BACKENDS else None

    @property
    def flash_fp8(self) -> bool | None:
        """Unpadded attention through :func:`tabserve.ops.flash_attention` on fp8 (True) or
        half (False) operands; None: SDPA."""
        return _FLASH_OPERANDS.get(self.attention)

    @property
    def sdpa_backend(self):
        """The ``torch.nn.attention.SDPBackend`` the stage's SDPA calls are restricted to, or
        None (no restriction: tabserve's kernels, or no choice)."""
        if self.attention not in SDPA_BACKENDS:
            return None
        from torch.nn.attention import SDPBackend

        return getattr(SDPBackend, SDPA_BACKENDS[self.attention])


#: What an unconfigured model runs: PyTorch's attention and the modules themselves.
DEFAULT_KERNELS = StageKernels()


def use_stage_kernels(module: torch.nn.Module, kernels: StageKernels) -> None:
    """Hands ``kernels`` to every module inside ``module`` (a stage, or a whole model) that has
    kernel choices (those with a ``kernels`` attribute)."""
    if not isinstance(kernels, StageKernels):
        raise TypeError(f"kernels must be a StageKernels, got {type(kernels).__name__}")
    for child in module.modules():
        if hasattr(child, "kernels"):
            child.kernels = kernels
