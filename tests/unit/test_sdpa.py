"""--sdpa_kernel: which of torch's scaled_dot_product_attention kernels a run lets sdpa choose
(core/sdpa.py), the DeepCompile arch-list check beside it, and the kernels' benchmark on a CPU."""

import json

import pytest
import torch
from torch.profiler import profile

from backends.deepspeed_spec import check_arch_list
from core.config import RunConfig
from core.sdpa import SDPA_KERNELS, apply_sdpa_kernel, sdpa_backends
from gptlite.errors import ConfigError
from gptlite.model import GPTLite, preset


@pytest.fixture(autouse=True)
def torch_default():
    yield
    apply_sdpa_kernel("auto")  # the process's toggles as torch starts them, for the tests after


def _toggles() -> tuple[bool, ...]:
    b = torch.backends.cuda
    return b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(), b.math_sdp_enabled()


def _attention_ops(model, x) -> set[str]:
    with profile() as prof:
        model(x)
    return {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}


def test_a_named_kernel_is_enabled_alone_and_auto_is_torchs_default():
    apply_sdpa_kernel("math")
    assert _toggles() == (False, False, False, True)
    apply_sdpa_kernel("flash")
    assert _toggles() == (True, False, False, False)
    apply_sdpa_kernel("auto")
    assert _toggles() == (True, True, True, True)
    assert len(sdpa_backends("auto")) == len(SDPA_KERNELS) - 1
    with pytest.raises(ConfigError, match="sdpa_kernel must be one of"):
        apply_sdpa_kernel("fa3")


def test_gptlites_attention_runs_the_kernel_named():
    torch.manual_seed(0)
    model = GPTLite(preset("tiny", attention="sdpa", dropout=0.0)).eval()
    x = torch.randint(0, 65, (2, 16))
    apply_sdpa_kernel("math")
    assert "aten::_scaled_dot_product_attention_math" in _attention_ops(model, x)
    apply_sdpa_kernel("flash")
    ops = _attention_ops(model, x)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops


def test_the_kernel_is_a_recorded_setting():
    assert RunConfig(attention="sdpa", sdpa_kernel="math").sdpa_kernel == "math"
    assert RunConfig().sdpa_kernel == "auto"
    with pytest.raises(ConfigError, match="needs --attention sdpa"):
        RunConfig(sdpa_kernel="math")
    # an hf: model calls sdpa itself: no --attention to check
    assert RunConfig(model="hf:gpt2", sdpa_kernel="math").sdpa_kernel == "math"


@pytest.mark.parametrize("arch_list,ok", [
    (None, True), ("", True), ("9.0", True), ("8.0;9.0+PTX", True), ("8.6 9.0", True),
    ("9.0a", False), ("8.0;9.0a", False), ("Hopper", False)])
def test_deepcompile_refuses_an_arch_list_deepspeed_cannot_read(arch_list, ok):
    if ok:
        check_arch_list("z3_deepcompile.json", arch_list)
    else:
        with pytest.raises(ConfigError, match=r"z3_deepcompile.json: .*TORCH_CUDA_ARCH_LIST=.*set it to plain"):
            check_arch_list("z3_deepcompile.json", arch_list)


def test_the_kernel_benchmark_times_what_this_device_has(tmp_path):
    from benchmarks.sdpa_kernels import time_kernel

    shape = (1, 2, 32, 8)
    math = time_kernel("math", shape, 0.1, "cpu", 1, 2)
    assert math["forward_ms"] > 0 and math["forward_backward_ms"] > 0
    cudnn = time_kernel("cudnn", shape, 0.0, "cpu", 1, 2)
    assert "error" in cudnn and "forward_ms" not in cudnn
    flash_with_dropout = time_kernel("flash", shape, 0.1, "cpu", 1, 2)  # the CPU's flash kernel has no dropout
    assert "error" in flash_with_dropout
    json.dumps([math, cudnn])  # what --json writes
