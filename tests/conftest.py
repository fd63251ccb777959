"""Test-process hygiene: CPU JAX initialised before torch, no persistent compile cache."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CG_JAX_COMPILATION_CACHE", "off")

import jax  # noqa: E402  (initialise JAX before any test imports torch)

jax.config.update("jax_default_matmul_precision", "highest")
