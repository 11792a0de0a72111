"""The decode kernel's resource check, on the CPU: NVRTC builds sm_90 machine code without
a GPU, and the CUDA binary utilities (the ``cuda`` extra's nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels) read it (pagedkv.kernels.resources). Every checked variant:
no register spills, at most REGISTER_CAP registers (three CTAs an SM), and a main loop
(the innermost loop around its cp.async wait) without a barrier or a plain global load,
that streams K/V with cp.async (128-bit where a lane holds 16 bytes, read back from shared
memory 128 bits at a time), reduces with shuffles and converts no integer to a float.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC) is not installed")

from pagedkv.kernels import build, decode_plans, resources  # noqa: E402
from pagedkv.kernels.options import CompileOptions  # noqa: E402

pytestmark = pytest.mark.skipif(
    resources.tool("cuobjdump") is None or resources.tool("nvdisasm") is None,
    reason="the CUDA binary utilities are not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm: "
           "the cuda extra)")

IDS = [f"{v.name(layout)}" for v, layout in resources.CHECKED_VARIANTS]


@pytest.fixture(scope="module")
def facts():
    with ThreadPoolExecutor(max_workers=2) as pool:  # NVRTC releases the GIL
        return dict(zip(IDS, pool.map(lambda vl: resources.decode_facts(*vl), resources.CHECKED_VARIANTS)))


@pytest.mark.parametrize("name", IDS)
def test_no_spills_within_the_register_cap(facts, name):
    f = facts[name]
    assert f["stack"] == 0 and f["local"] == 0, f
    assert 0 < f["registers"] <= resources.REGISTER_CAP, f


@pytest.mark.parametrize("name", IDS)
def test_main_loop_streams_through_the_ring_without_barriers_or_conversions(facts, name):
    f = facts[name]
    assert f["loop_instructions"] > 0, "no loop around the cp.async wait in the SASS"
    assert f["barriers"] == 0 and f["global_loads"] == 0, f
    assert f["cp_async"] > 0 and f["shuffles"] > 0 and f["ffma"] > 0, f
    assert f["int_to_float"] == 0, f
    if f["vector_bytes"] == 16:
        assert f["cp_async_128"] > 0 and f["shared_loads_128"] > 0, f


def test_the_loop_finder_sees_a_barrier_and_a_conversion_when_there_is_one():
    """The checks above can fail: a loop with a barrier and an int->float conversion."""
    from pagedkv.kernels.sources import KernelSource

    src = KernelSource("probe.cu", b"""
extern "C" __global__ void probe(const int* a, float* o, int n) {
  __shared__ float s[128];
  float acc = 0.0f;
  for (int i = 0; i < n; ++i) {
    asm volatile("cp.async.wait_group 2;");
    s[threadIdx.x] = (float)a[i * 128 + threadIdx.x];
    __syncthreads();
    acc += s[(threadIdx.x + 1) % 128];
  }
  o[threadIdx.x] = acc;
}
""")
    cubin = build.build(src, CompileOptions(arch="sm_90", target="cubin")).data
    loop = resources.main_loop(resources.function_sass(cubin, "probe"), "DEPBAR.LE SB0, 0x2")
    assert any(op.startswith("BAR") for op in loop) and any(op.startswith(("I2F", "I2FP")) for op in loop)
    assert resources.resource_usage(cubin)["probe"]["REG"] > 0


@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
def test_variants_compile_for_the_other_architectures(arch):
    for v in (decode_plans.decode_variant("int4", 128, 4, 4), decode_plans.decode_variant("f16", 64, 8)):
        ptx = build.build("decode_attention.cu", CompileOptions(arch=arch, defines=v.defines("HND"))).data
        assert f".entry {v.name('HND')}(".encode() in ptx and b"cp.async" in ptx
