"""`psrec.machine`: the CPU's model and ISA features from /proc/cpuinfo text, and what
``training.dense_precision`` resolves to on CPUs with and without native bf16 and on GPUs.

The cpuinfo texts are abridged from real machines (the lines psrec reads, with their flags); nothing
here reads this machine's CPU.
"""

from __future__ import annotations

import pytest

from psrec.machine import (
    FEATURES_VARIABLE,
    cpu_model,
    describe_machine,
    isa_features,
    native_bf16,
    precisions_differ,
    resolve_dense_precision,
    summarize_trainers,
)

COMMON = "fpu vme de pse tsc msr pae sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c"


def cpuinfo(model: str, flags: str) -> str:
    """Two processors' worth of /proc/cpuinfo (the first one's values are read)."""
    block = f"processor\t: {{n}}\nvendor_id\t: x\nmodel name\t: {model}\nflags\t\t: {COMMON} {flags}\n"
    return block.format(n=0) + "\n" + block.format(n=1)


# Intel Xeon (Cascade Lake): AVX-512F and VNNI, neither avx512_bf16 nor AMX (issue 42's third machine)
INTEL_NO_BF16 = cpuinfo(
    "Intel(R) Xeon(R) CPU @ 2.80GHz", "avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"
)
# AMD EPYC (Zen 4): avx512_bf16, no AMX
AMD_ZEN4 = cpuinfo(
    "AMD EPYC 9654 96-Core Processor", "avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni"
)
# Intel Xeon (Sapphire Rapids): AMX and avx512_bf16
SAPPHIRE_RAPIDS = cpuinfo(
    "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
    "avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8 avx512_fp16",
)
OLD_AVX2 = cpuinfo("Intel(R) Xeon(R) CPU E5-2686 v4 @ 2.30GHz", "avx2")
NO_OVERRIDE: dict[str, str] = {}


def test_cpu_model_and_isa_features_are_read_from_cpuinfo() -> None:
    assert cpu_model(AMD_ZEN4) == "AMD EPYC 9654 96-Core Processor"
    assert isa_features(INTEL_NO_BF16, environ=NO_OVERRIDE) == ["avx2", "avx512f", "avx512_vnni"]
    assert isa_features(AMD_ZEN4, environ=NO_OVERRIDE) == ["avx2", "avx512f", "avx512_bf16", "avx512_vnni"]
    assert isa_features(SAPPHIRE_RAPIDS, environ=NO_OVERRIDE) == [
        "avx2",
        "avx512f",
        "avx512_bf16",
        "avx512_vnni",
        "amx_bf16",
        "amx_int8",
        "amx_tile",
    ]
    assert isa_features(OLD_AVX2, environ=NO_OVERRIDE) == ["avx2"]
    assert isa_features("", environ=NO_OVERRIDE) == []  # no /proc/cpuinfo (not Linux)
    assert cpu_model("") != ""  # the platform's name for it, or "unknown"


def test_the_variable_replaces_the_cpus_features() -> None:
    assert isa_features(AMD_ZEN4, environ={FEATURES_VARIABLE: "avx2, avx512f"}) == ["avx2", "avx512f"]
    assert isa_features(INTEL_NO_BF16, environ={FEATURES_VARIABLE: "amx_bf16,avx2"}) == ["avx2", "amx_bf16"]
    assert isa_features(AMD_ZEN4, environ={FEATURES_VARIABLE: ""}) == []
    with pytest.raises(ValueError, match=f"{FEATURES_VARIABLE}: avx512_fp16 not among the ISA features"):
        isa_features(AMD_ZEN4, environ={FEATURES_VARIABLE: "avx2,avx512_fp16"})
    described = describe_machine(AMD_ZEN4, environ={FEATURES_VARIABLE: "avx2"})
    assert described["isa_features"] == ["avx2"] and described["isa_features_from"] == FEATURES_VARIABLE
    described = describe_machine(AMD_ZEN4, environ=NO_OVERRIDE)
    assert described["cpu_model"] == "AMD EPYC 9654 96-Core Processor"
    assert described["isa_features_from"] == "/proc/cpuinfo" and described["cores"] >= 1


@pytest.mark.parametrize(
    ("text", "native"),
    [(INTEL_NO_BF16, False), (OLD_AVX2, False), (AMD_ZEN4, True), (SAPPHIRE_RAPIDS, True)],
    ids=["intel-no-bf16", "avx2-only", "amd-zen4", "sapphire-rapids"],
)
def test_auto_picks_bf16_only_where_the_cpu_computes_it(text: str, native: bool) -> None:
    features = isa_features(text, environ=NO_OVERRIDE)
    assert native_bf16(features) is native
    decision = resolve_dense_precision("auto", "cpu", features)
    assert decision.setting == "auto"
    assert decision.resolved == ("bf16" if native else "fp32")
    assert decision.warning is None  # auto never picks an emulated precision
    if native:
        assert "natively" in decision.reason and "avx512_bf16" in decision.reason
    else:
        assert "no native bf16" in decision.reason


def test_amx_alone_is_native_bf16() -> None:
    assert native_bf16(["avx2", "avx512f", "amx_bf16", "amx_tile"])
    assert resolve_dense_precision("auto", "cpu", ["amx_bf16"]).resolved == "bf16"


def test_explicit_settings_are_kept_and_emulated_bf16_warns() -> None:
    intel = isa_features(INTEL_NO_BF16, environ=NO_OVERRIDE)
    amd = isa_features(AMD_ZEN4, environ=NO_OVERRIDE)
    emulated = resolve_dense_precision("bf16", "cpu", intel)
    assert emulated.resolved == "bf16"  # kept as set
    assert emulated.warning is not None
    assert "0.38-0.39x" in emulated.warning and "auto or fp32" in emulated.warning
    assert emulated.to_dict()["warning"] == emulated.warning
    native = resolve_dense_precision("bf16", "cpu", amd)
    assert native.resolved == "bf16" and native.warning is None and "warning" not in native.to_dict()
    for features in (intel, amd):
        fp32 = resolve_dense_precision("fp32", "cpu", features)
        assert (fp32.resolved, fp32.warning) == ("fp32", None)


def test_on_cuda_the_gpu_decides() -> None:
    intel = isa_features(INTEL_NO_BF16, environ=NO_OVERRIDE)
    amd = isa_features(AMD_ZEN4, environ=NO_OVERRIDE)
    assert resolve_dense_precision("auto", "cuda", intel, cuda_bf16=True).resolved == "bf16"
    old_gpu = resolve_dense_precision("auto", "cuda", amd, cuda_bf16=False)
    assert old_gpu.resolved == "fp32" and "GPU" in old_gpu.reason
    forced = resolve_dense_precision("bf16", "cuda", amd, cuda_bf16=False)
    assert forced.resolved == "bf16" and forced.warning is not None and "GPU" in forced.warning
    assert resolve_dense_precision("bf16", "cuda", intel, cuda_bf16=True).warning is None
    assert resolve_dense_precision("fp32", "cuda", amd, cuda_bf16=True).resolved == "fp32"


def test_unknown_settings_and_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="training.dense_precision must be one of auto, fp32, bf16"):
        resolve_dense_precision("fp16", "cpu", [])
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        resolve_dense_precision("auto", "mps", [])


def test_trainer_reports_are_summarized_once_unless_they_differ() -> None:
    def report(features: list[str]) -> dict[str, object]:
        decision = resolve_dense_precision("auto", "cpu", features)
        return {
            "machine": {"cpu_model": "x", "isa_features": features},
            "dense_precision": decision.to_dict(),
        }

    same = [report(["avx2"]), report(["avx2"])]
    assert summarize_trainers(same) == {
        "machine": same[0]["machine"],
        "dense_precision": same[0]["dense_precision"],
    }
    assert not precisions_differ(same)
    mixed = [report(["avx2"]), report(["avx2", "avx512_bf16"])]
    summary = summarize_trainers(mixed)
    assert summary["dense_precision"]["resolved"] == "fp32" and summary["trainer_machines"] == mixed
    assert precisions_differ(mixed)
    assert summarize_trainers([]) == {}
