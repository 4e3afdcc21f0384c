"""GLM-5 composed from the lab's kernels: config + presets, the network, its cache, checkpoint loading."""
from .config import GLM5Config, PRESETS, preset

__all__ = ["GLM5Config", "PRESETS", "preset"]
from .model import GLM5ForCausalLM, count_parameters  # noqa: E402
from .cache import PagedCache  # noqa: E402
from .attention_modes import ATTENTION_MODES, AttentionMode, register_attention_mode  # noqa: E402

__all__ += ["GLM5ForCausalLM", "count_parameters", "PagedCache", "ATTENTION_MODES", "AttentionMode",
            "register_attention_mode"]
from .quantization import DEFAULT_SKIP, ensure_quantized, quantize, quantize_model, save_quantized  # noqa: E402

__all__ += ["quantize", "quantize_model", "ensure_quantized", "save_quantized", "DEFAULT_SKIP"]
