"""moelora: the Mixture-of-Experts layer of LLMs (vLLM/SGLang ``fused_moe`` semantics).

The ops in :mod:`moelora.ops` take numpy arrays (float32, float16, ml_dtypes.bfloat16,
int32, int64) or torch tensors (CPU or CUDA). When torch is importable, importing this
package also registers the ``torch.ops.moelora.*`` custom ops and exposes
:class:`moelora.FusedMoE` (with multi-LoRA adapter slots: ``max_loras``, ``load_adapter``).

The compiled extension ``_moelora`` is looked up first in the folder named by the
environment variable ``MOELORA_EXT_DIR`` (a CMake build dir, for development without
pip), then inside this package (a pip install), then in the checkout's build folder
(``build/``, or ``MOELORA_BUILD_DIR``) when the package is imported from a checkout.
"""

import glob
import importlib.machinery
import importlib.util
import os
import sys
import warnings


def _extension_in(folder):
    """The path of a compiled _moelora in `folder`, or None."""
    candidates = sorted(
        path
        for suffix in importlib.machinery.EXTENSION_SUFFIXES
        for path in glob.glob(os.path.join(glob.escape(folder), "_moelora" + suffix))
    )
    return candidates[0] if candidates else None


def _load_extension():
    """The compiled extension: from MOELORA_EXT_DIR, else inside this package (a pip
    install), else from the checkout's build folder (tools/build.sh's, MOELORA_BUILD_DIR
    or build/) when this package is the checkout's python/moelora."""
    package_dir = os.path.dirname(os.path.abspath(__file__))
    checkout = os.path.dirname(os.path.dirname(package_dir))
    folders = [os.environ.get("MOELORA_EXT_DIR"), package_dir]
    if os.path.isfile(os.path.join(checkout, "tools", "build.sh")):
        folders.append(os.path.join(checkout, os.environ.get("MOELORA_BUILD_DIR", "build")))
    for folder in folders:
        path = _extension_in(folder) if folder else None
        if path is None:
            continue
        # Registered under the package's name so that `moelora._moelora` and pickled
        # references resolve to this one copy.
        spec = importlib.util.spec_from_file_location(f"{__name__}._moelora", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    searched = ", ".join(f for f in folders if f)
    raise ImportError(
        f"moelora: the compiled extension _moelora was not found (searched: {searched}). Build it with "
        f"`bash tools/build.sh` from the repository root (it lands in build/), or set MOELORA_EXT_DIR to the "
        f"CMake build folder that holds _moelora*.so, or `pip install .`")


def _torch_importable():
    if importlib.util.find_spec("torch") is None:
        return False
    try:
        import torch  # noqa: F401
    except Exception as exc:  # a broken torch install must not break the numpy API
        warnings.warn(f"moelora: torch is installed but failed to import ({exc}); "
                      "torch.ops.moelora is not registered", RuntimeWarning, stacklevel=3)
        return False
    return True


# NOTE: torch before the extension. The other order crashed `import moelora` (SIGSEGV inside
# `import torch`, torch 2.11 cu130 on the H200 machines, 2026-11-28) whenever the caller
# had not imported torch first; the tests and examples always had.
HAS_TORCH = _torch_importable()
_ext = _load_extension()

Error = _ext.Error
Activation = _ext.Activation
TensorView = _ext.TensorView
view = _ext.view
cuda_available = _ext.cuda_available
moe_align_block_size_capacity = _ext.moe_align_block_size_capacity
moe_lora_align_block_size_capacity = _ext.moe_lora_align_block_size_capacity
fused_moe_lora_workspace_size = _ext.fused_moe_lora_workspace_size
fused_experts_workspace_size = _ext.fused_experts_workspace_size
MAX_LORA_RANK = _ext.MAX_LORA_RANK
MAX_LORA_ADAPTERS = _ext.MAX_LORA_ADAPTERS
ROUTING_BAD_EXPERT_ID = _ext.ROUTING_BAD_EXPERT_ID
ROUTING_BAD_ADAPTER_ID = _ext.ROUTING_BAD_ADAPTER_ID
ROUTING_BAD_EXPERT_MAP = _ext.ROUTING_BAD_EXPERT_MAP
fused_experts_block_size = _ext.fused_experts_block_size
__version__ = _ext.version()


def version():
    """The version of the compiled library."""
    return _ext.version()


from .ops import (  # noqa: E402  (the extension must be loaded first)
    MoeLora,
    MoeQuant,
    QUANT_DTYPES,
    fused_experts,
    fused_moe,
    fused_moe_lora,
    gelu_and_mul,
    moe_align_block_size,
    moe_lora_align_block_size,
    moe_sum_reduce,
    per_token_group_quant,
    quant_scheme,
    quantize,
    quantize_weights,
    scaled_fp8_quant,
    scaled_int8_quant,
    sparse_mla_decode,
    silu_and_mul,
    swiglu_oai_and_mul,
)
QuantScheme = _ext.QuantScheme

if HAS_TORCH:
    from . import torch_ops  # noqa: E402,F401  (registers torch.ops.moelora.*)
    from .layer import FusedMoE  # noqa: E402,F401

__all__ = [
    "Activation",
    "Error",
    "HAS_TORCH",
    "MAX_LORA_ADAPTERS",
    "MAX_LORA_RANK",
    "ROUTING_BAD_ADAPTER_ID",
    "ROUTING_BAD_EXPERT_ID",
    "ROUTING_BAD_EXPERT_MAP",
    "MoeLora",
    "MoeQuant",
    "QUANT_DTYPES",
    "QuantScheme",
    "TensorView",
    "cuda_available",
    "fused_experts",
    "fused_experts_block_size",
    "fused_experts_workspace_size",
    "fused_moe",
    "fused_moe_lora",
    "fused_moe_lora_workspace_size",
    "gelu_and_mul",
    "moe_align_block_size",
    "moe_align_block_size_capacity",
    "moe_lora_align_block_size",
    "moe_lora_align_block_size_capacity",
    "moe_sum_reduce",
    "per_token_group_quant",
    "quant_scheme",
    "quantize",
    "quantize_weights",
    "scaled_fp8_quant",
    "scaled_int8_quant",
    "sparse_mla_decode",
    "silu_and_mul",
    "swiglu_oai_and_mul",
    "version",
    "view",
]
if HAS_TORCH:
    __all__.append("FusedMoE")
