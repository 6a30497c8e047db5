"""Start-up prints no library noise, and the filters drop only the known messages."""

import enum
import logging

import torch

from runtime.library_noise import quiet_single_process, silence_library_noise


class ForeignEnum(enum.Enum):
    A = 1


def test_the_known_messages_are_dropped_and_others_kept(caplog):
    silence_library_noise()
    silence_library_noise()  # idempotent: one filter per logger
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    assert len(pytree.filters) == 1
    deprecated = ("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
                  "Calling register_constant() on Enum subclasses is deprecated")
    torchao_enum = enum.Enum("KernelPreference", "AUTO")
    torchao_enum.__module__ = "torchao.quantization.quantize_.common.kernel_preference"
    with caplog.at_level(logging.WARNING):
        pytree.warning(deprecated, torchao_enum)
        torchao.warning("Failed to load /venv/lib/python3.11/site-packages/torchao/_C_mxfp8.so: Could not load")
        pytree.warning(deprecated, ForeignEnum)  # the controls: another library's enum,
        torchao.warning("Failed to load my_kernel.so: Could not load")  # another library file,
        torchao.warning("torchao is older than torch")  # another torchao warning
    kept = [r.getMessage() for r in caplog.records]
    assert any("ForeignEnum" in m for m in kept) and "torchao is older than torch" in kept
    assert "Failed to load my_kernel.so: Could not load" in kept
    assert len(kept) == (4 if torch.cuda.is_available() else 3), kept  # on CUDA the torchao kernel line stays


def test_dcp_one_process_warnings_are_dropped_inside_the_block_only():
    import warnings

    def warn_all():
        for verb in ("load", "save"):
            warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
                          f"{verb} in a single process.", UserWarning)
        warnings.warn("torch.distributed is not available on this platform", UserWarning)  # another message

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_single_process():
            warn_all()
        inside = [str(w.message) for w in seen]
        warn_all()  # the control: outside the block every one shows
    assert inside == ["torch.distributed is not available on this platform"]
    assert len(seen) == 4
