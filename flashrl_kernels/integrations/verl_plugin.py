"""verl's plugin entry point (`verl.plugins`: flashrl = flashrl_kernels.integrations.verl_plugin).

verl imports every `verl.plugins` entry point while `import verl` runs and swallows their errors at debug
level. Importing this module patches verl (flashrl_kernels.integrations.verl.patch) only when the
environment asks for it (FLASHRL_PATCH names "verl", e.g. FLASHRL_PATCH=verl or FLASHRL_PATCH=trl,verl),
and says so with a warning when it cannot, so a failed patch is never silent.
"""
import logging
import os
import warnings


def _wanted() -> bool:
    return "verl" in {s.strip().lower() for s in os.environ.get("FLASHRL_PATCH", "").split(",")}


if _wanted():
    try:
        from flashrl_kernels.integrations import verl as _verl_adapter

        _verl_adapter.patch()
    except Exception as _e:
        _msg = f"flashrl_kernels: FLASHRL_PATCH asks to patch verl, but it failed ({type(_e).__name__}: {_e}); " \
               "verl runs unpatched"
        logging.getLogger("flashrl_kernels").warning(_msg)
        warnings.warn(_msg, RuntimeWarning, stacklevel=2)
