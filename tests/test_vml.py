"""The oneMKL VML warm-up (longkv.vml) runs as soon as a computing package is imported."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from longkv.vml import VML_OPS, warm_up_vml


@pytest.mark.parametrize("package", ["longkv.kvm", "longkv.rwkv", "longkv.models", "longkv.fold"])
def test_importing_a_computing_package_warms_up_vml(package: str) -> None:
    script = f"import {package}, longkv.vml; print(longkv.vml.warm_up_vml.cache_info().currsize)"
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "1"


def test_warm_up_calls_every_vml_op_where_mkl_is_built_in() -> None:
    called = warm_up_vml()
    assert called == (VML_OPS if torch.backends.mkl.is_available() else ())
    assert all(callable(getattr(torch, name)) for name in VML_OPS)
