"""The profiler script's kernel families (benchmarks/profile_tabiclv2.py): kernel names as the H200
runs printed them fall in the family a reader expects, and only kernel rows are summed."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import profile_tabiclv2 as profiler

# Names seen in H200 logs and profiles (torch 2.11.0+cu130, cuDNN 9.19), shortened templates.
NAMES = [
    (
        (
            "void tabserve::ops::(anonymous namespace)::small_head_attention_kernel<__half>"
            "(tabserve::ops::(anonymous namespace)::Params)"
        ),
        "tabserve head-dim-16 attention",
    ),
    (
        (
            "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_"
            "cga1x1x1_kernel0_0"
        ),
        "cuDNN attention",
    ),
    (
        (
            "fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel"
            "<cutlass::half_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)"
        ),
        "memory-efficient attention",
    ),
    (
        (
            "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, "
            "false, cutlass::half_t>, false, false>(pytorch_flash::Flash_fwd_params)"
        ),
        "flash attention",
    ),
    ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "GEMM"),
    ("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTT", "GEMM"),
    ("triton_poi_fused__to_copy_add_native_layer_norm_0", "Triton (Inductor-fused)"),
    (  # Inductor's kernel feeding our op (RoPE and head split, H200 profile of a compiled cell)
        (
            "triton_poi_fused__to_copy_add_arange_cat_cos_mul_neg_sin_slice_small_head_attention"
            "_split_transpose_unsqueeze_view_39"
        ),
        "Triton (Inductor-fused)",
    ),
    (
        "void tabserve::ops::(anonymous namespace)::pad_rows_kernel<float>(float const*, long)",
        "other tabserve",
    ),
    (
        (
            "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast"
            "<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>>(int, T3)"
        ),
        "copies and casts",
    ),
    (
        "void at::native::vectorized_layer_norm_kernel<c10::Half, float>(int, float)",
        "normalisation",
    ),
    ("some_kernel_nobody_named", "other"),
]


@pytest.mark.parametrize("name, family", NAMES, ids=[family for _, family in NAMES])
def test_kernel_names_fall_in_their_family(name, family):
    assert profiler.kernel_family(name) == family


def test_only_kernel_rows_are_summed_per_family():
    def row(key, us, device_type):
        return SimpleNamespace(key=key, self_device_time_total=us, device_type=device_type)

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [
        row(NAMES[1][0], 3000.0, cuda),
        row(NAMES[1][0], 1500.0, cuda),
        row(NAMES[4][0], 2000.0, cuda),
        row("aten::scaled_dot_product_attention", 4500.0, cpu),  # its kernels already counted
        row(NAMES[0][0], 250.0, cuda),
    ]
    assert profiler.kernel_families(events) == {
        "cuDNN attention": 4.5,
        "GEMM": 2.0,
        "tabserve head-dim-16 attention": 0.25,
    }
    assert list(profiler.kernel_families(events)) == [
        "cuDNN attention",
        "GEMM",
        "tabserve head-dim-16 attention",
    ]


def _event(start, end, kernel):
    device = torch.autograd.DeviceType.CUDA if kernel else torch.autograd.DeviceType.CPU
    return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), device_type=device)


def test_timeline_splits_the_device_span_into_busy_time_gaps_and_stalls():
    # Host operators 0-1000 us; kernels overlap (100-150 and 120-200: 100 us busy), then a 5 us
    # gap (not a stall), then a 300 us stall before the last kernel (505-600 and 900-950).
    events = [_event(0, 1000, False), _event(50, 60, False)]
    events += [_event(*span, True) for span in [(120, 200), (100, 150), (205, 600), (900, 950)]]
    got = profiler.timeline(events)
    # Independent arithmetic: busy = 100 + 395 + 50, gaps = 5 + 300, span = 950 - 100.
    assert got == {
        "kernels": 4,
        "gpu_span_ms": 0.85,
        "gpu_busy_ms": 0.545,
        "gaps_ms": 0.305,
        "stalls": 1,
        "stall_ms": 0.3,
        "host_lead_ms": 0.1,
        "host_tail_ms": 0.05,
    }
    assert got["gpu_busy_ms"] + got["gaps_ms"] == pytest.approx(got["gpu_span_ms"])


def test_timeline_without_kernels_is_empty():
    assert profiler.timeline([_event(0, 10, False)]) == {}
