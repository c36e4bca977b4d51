"""Candidate switches for a whole GPU run, from the environment (a candidate's GPU tests and
sanitizer cases before it is the default):
    CUTEATTN_TEST_SM90_CONFIG="NAME=VALUE,..."  constants of cuteattn/kernels/sm90/config.py
    CUTEATTN_TEST_SM80_CONFIG="NAME=VALUE,..."  constants of cuteattn/kernels/sm80/config.py
e.g. CUTEATTN_TEST_SM90_CONFIG=FP8_V_IN_KERNEL_MAX_SEQLEN_Q=0 or
CUTEATTN_TEST_SM80_CONFIG=FOLD_MAX_STEPS=0. Applied by conftest.py (pytest) and by
gpu_sanitize.py's child processes; a name the config lacks is an error, not a silent no-op."""
import importlib
import os

SOURCES = {"CUTEATTN_TEST_SM90_CONFIG": "cuteattn.kernels.sm90.config",
           "CUTEATTN_TEST_SM80_CONFIG": "cuteattn.kernels.sm80.config"}


def apply() -> list:
    """Sets every constant the variables name; returns the (module, name, value) set."""
    done = []
    for variable, module_name in SOURCES.items():
        items = list(filter(None, os.environ.get(variable, "").split(",")))
        if not items:
            continue
        config = importlib.import_module(module_name)
        for item in items:
            name, value = item.split("=")
            if not hasattr(config, name):
                raise AttributeError(f"{variable}: {module_name} has no {name}")
            old = getattr(config, name)
            new = value in ("True", "1") if isinstance(old, bool) else type(old)(value)
            setattr(config, name, new)
            done.append((module_name, name, new))
    return done
