"""The measured kernel choice (ops.kernel_choice) with injected candidates and timers.

What runs the real kernels through the choice (the fused kernel in the Triton interpreter,
SDPA, the float32 reference) is in tests/ops/test_triton_attention.py.
"""
import json
import logging
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from swin_backbone import SwinBackbone, ops
from swin_backbone.ops import kernel_choice as kc

from ..conftest import small_arch

SIG = kc.Signature("Test GPU sm_90", "float16", "-", 7, 3, 32, True, False)


@pytest.fixture(autouse=True)
def fresh_decisions(tmp_path, monkeypatch):
    """Each test starts with no decisions and its own cache file."""
    monkeypatch.setenv("SWIN_BACKBONE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(kc.ENV_VAR, raising=False)
    monkeypatch.delenv(kc.CACHE_ENV_VAR, raising=False)
    kc.forget(persisted=False)
    yield
    kc.forget(persisted=False)


def outputs(scale=1.0, grad_scale=1.0, shape=(2, 8)):
    torch.manual_seed(0)
    out = torch.randn(shape)
    return out * scale, torch.ones(shape) * grad_scale, torch.ones(3, 2)


def candidate(name, kernel="triton", warps=0, run=None, **wrong):
    return kc.Candidate(name, kernel, run or (lambda: outputs(**wrong)), warps)


def raises(error):
    def run():
        raise error

    return run


def fixed_times(times):
    """A timer giving each candidate (recognised by its run function) a fixed time."""
    return lambda fn: times[fn]


@pytest.fixture
def logged():
    """The kernel-choice lines sent to mmengine's current logger, as ``'LEVEL message'``."""
    from mmengine.logging import MMLogger

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            if "SwinBackbone attention" in record.getMessage():
                lines.append(f"{record.levelname} {record.getMessage()}")

    logger, handler = MMLogger.get_current_instance(), Keep()
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def test_bad_candidates_are_rejected_and_the_fastest_good_one_wins(logged):
    compile_error = candidate("triton/broken", run=raises(RuntimeError("PTXASError: ptxas failed\nmore lines")))
    wrong_out = candidate("triton/wrong-values", scale=1.05)
    wrong_grad = candidate("triton/wrong-grads", grad_scale=-1.0)
    slow = candidate("sdpa", "sdpa")
    fast = candidate("triton/warps4", warps=4)
    timer = fixed_times({slow.run: 2.0, fast.run: 1.0})
    choice = kc.decide(SIG, lambda: [compile_error, wrong_out, wrong_grad, slow, fast], outputs, timer)
    assert (choice.kernel, choice.warps, choice.source) == ("triton", 4, "measured")
    assert choice.times_ms == {"sdpa": 2.0, "triton/warps4": 1.0}
    assert choice.rejected["triton/broken"] == "RuntimeError: PTXASError: ptxas failed"
    assert "output off by" in choice.rejected["triton/wrong-values"]
    assert "grad qkv off by" in choice.rejected["triton/wrong-grads"]
    assert "output" not in choice.rejected["triton/wrong-grads"]
    # one log line, a warning (candidates were rejected), naming each reason
    lines = logged
    assert len(lines) == 1 and "WARNING" in lines[0]
    assert "PTXASError" in lines[0] and SIG.key() in lines[0]
    # decided once: the candidates are not built again
    assert kc.decide(SIG, lambda: pytest.fail("measured twice"), outputs, timer) is choice


def test_a_slower_kernel_is_not_chosen():
    slow, fast = candidate("triton/warps8", warps=8), candidate("sdpa", "sdpa")
    choice = kc.decide(SIG, lambda: [slow, fast], outputs, fixed_times({slow.run: 3.0, fast.run: 1.0}))
    assert (choice.kernel, choice.warps) == ("sdpa", 0)


def test_non_finite_values_are_rejected():
    nan = candidate("triton", run=lambda: (torch.full((2, 8), float("nan")),) + outputs()[1:])
    choice = kc.decide(SIG, lambda: [nan, candidate("sdpa", "sdpa")], outputs, lambda fn: 1.0)
    assert choice.kernel == "sdpa" and "output off by inf" in choice.rejected["triton"]


def test_nothing_correct_falls_back_to_plain_attention():
    choice = kc.decide(SIG, lambda: [candidate("sdpa", "sdpa", scale=2.0)], outputs, lambda fn: 1.0)
    assert choice.kernel == "plain" and "sdpa" in choice.rejected


def test_tolerance_follows_the_dtype():
    slightly_off = candidate("triton", scale=1.01)  # 1e-2 relative
    bf16 = kc.Signature("Test GPU sm_90", "bfloat16", "-", 7, 3, 32, False, False)
    assert kc.decide(bf16, lambda: [slightly_off], outputs, lambda fn: 1.0).kernel == "triton"
    assert kc.decide(SIG, lambda: [slightly_off], outputs, lambda fn: 1.0).kernel == "plain"  # fp16: 5e-3


def test_forced_kernel_is_verified_and_says_why_it_cannot_run():
    broken = candidate("triton/warps8", warps=8, run=raises(RuntimeError("out of resources: shared memory")))
    with pytest.raises(RuntimeError, match="attention='triton'.*out of resources: shared memory"):
        kc.decide(SIG, lambda: [candidate("sdpa", "sdpa"), broken], outputs, lambda fn: 1.0, forced=True)
    good = candidate("triton/warps8", warps=8)
    choice = kc.decide(SIG, lambda: [candidate("sdpa", "sdpa"), good], outputs, lambda fn: pytest.fail("timed"),
                       forced=True)
    assert (choice.kernel, choice.source) == ("triton", "forced")


def test_decisions_persist_and_a_version_change_ignores_them(monkeypatch):
    slow, fast = candidate("sdpa", "sdpa"), candidate("triton/warps8", warps=8)
    kc.decide(SIG, lambda: [slow, fast], outputs, fixed_times({slow.run: 2.0, fast.run: 1.0}))
    with open(kc.cache_path()) as f:
        data = json.load(f)
    entry = data[kc.version_key()]
    assert entry["choices"][SIG.key()]["kernel"] == "triton" and entry["pending"] == []
    # a new process (forget the in-memory decisions) reads the file: nothing is measured
    kc.forget(persisted=False)
    cached = kc.decide(SIG, lambda: pytest.fail("measured again"), outputs, lambda fn: pytest.fail("timed"))
    assert (cached.kernel, cached.warps, cached.source) == ("triton", 8, "cache")
    # another torch / triton / driver / package version: the file's decisions do not apply
    kc.forget(persisted=False)
    first_key = kc.version_key()
    monkeypatch.setattr(kc, "version_key", lambda: "another version")
    again = kc.decide(SIG, lambda: [slow, fast], outputs, fixed_times({slow.run: 1.0, fast.run: 2.0}))
    assert (again.kernel, again.source) == ("sdpa", "measured")
    with open(kc.cache_path()) as f:
        assert set(json.load(f)) == {first_key, "another version"}  # both kept
    kc.forget(persisted=True)
    assert not os.path.exists(kc.cache_path())


def test_cache_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(kc.CACHE_ENV_VAR, "0")
    kc.decide(SIG, lambda: [candidate("sdpa", "sdpa")], outputs, lambda fn: 1.0)
    assert not os.path.exists(kc.cache_path())


def test_an_unreadable_cache_file_is_ignored(logged):
    os.makedirs(os.path.dirname(kc.cache_path()))
    with open(kc.cache_path(), "w") as f:
        f.write("{not json")
    choice = kc.decide(SIG, lambda: [candidate("sdpa", "sdpa")], outputs, lambda fn: 1.0)
    assert choice.kernel == "sdpa"
    assert any("ignoring unreadable" in line for line in logged)


def test_a_run_that_died_verifying_the_kernel_rejects_it_next_time():
    # The file marks a signature pending while the fused kernel runs for it the first time; a
    # process that dies there (a kernel corrupting the CUDA context) leaves the mark.
    def dies():
        with open(kc.cache_path()) as f:
            assert SIG.key() in json.load(f)[kc.version_key()]["pending"]  # marked before it runs
        raise SystemExit("the process dies here")

    with pytest.raises(SystemExit):
        kc.decide(SIG, lambda: [candidate("sdpa", "sdpa"), candidate("triton", run=dies)], outputs, lambda fn: 1.0)
    # simulate the dead process: the in-memory state is gone, the file keeps its mark
    with open(kc.cache_path()) as f:
        data = json.load(f)
    data[kc.version_key()]["pending"] = [SIG.key()]
    with open(kc.cache_path(), "w") as f:
        json.dump(data, f)
    kc.forget(persisted=False)
    choice = kc.decide(SIG, lambda: [candidate("sdpa", "sdpa"), candidate("triton")], outputs, lambda fn: 1.0)
    assert choice.kernel == "sdpa" and "previous run stopped" in choice.rejected["triton"]


def test_run_time_failure_switches_the_signature_to_sdpa(logged):
    kc.decide(SIG, lambda: [candidate("triton/warps8", warps=8)], outputs, lambda fn: 1.0)
    kc.reject(SIG, RuntimeError("CompilationError: new key"))
    choice = kc.known(SIG)
    assert choice.kernel == "sdpa" and "CompilationError" in choice.rejected["triton"]
    last = logged[-1]
    assert "WARNING" in last and "failed at run time" in last
    kc.forget(persisted=False)
    assert kc.decide(SIG, lambda: pytest.fail("measured"), outputs, lambda fn: 1.0).kernel == "sdpa"  # persisted


# ------------------------------------------------------------------------------ user control


def test_attention_argument_and_environment_variable(monkeypatch):
    with pytest.raises(ValueError, match=r"attention: expected one of \('auto', 'sdpa', 'triton'\), got 'fast'"):
        SwinBackbone(**small_arch(), attention="fast")
    with pytest.raises(ValueError, match="attention: expected one of .* got None"):
        SwinBackbone(**small_arch(), attention=None)
    model = SwinBackbone(**small_arch(), attention="sdpa")
    assert model.attention_mode == "sdpa"
    monkeypatch.setenv(kc.ENV_VAR, "triton")
    assert model.attention_mode == "triton"  # the variable overrides the argument
    monkeypatch.setenv(kc.ENV_VAR, "banana")
    with pytest.raises(ValueError, match="SWIN_BACKBONE_ATTENTION: expected one of .* got 'banana'"):
        SwinBackbone(**small_arch())


def test_forced_triton_on_a_cpu_says_why(monkeypatch):
    model = SwinBackbone(**small_arch(), attention="triton").eval()
    from swin_backbone.ops import triton_attention

    if triton_attention._interpreting():
        pytest.skip("the Triton interpreter runs the kernel on CPU tensors")
    with pytest.raises(RuntimeError, match="attention='triton'.*cannot run here: .*(CUDA|triton)"):
        model(torch.randn(1, 3, 32, 32))


@pytest.mark.parametrize("mode", ["auto", "sdpa"])
def test_cpu_keeps_its_plan(mode):
    # On the CPU 'auto' and 'sdpa' give today's CPU plan, bit for bit.
    torch.manual_seed(0)
    reference = SwinBackbone(**small_arch()).eval()
    model = SwinBackbone(**small_arch(), attention=mode).eval()
    model.load_state_dict(reference.state_dict())
    x = torch.randn(1, 3, 40, 52)
    for a, b in zip(model(x), reference(x)):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------ ranks


def _rank_main(rank, world, port, cache, results):
    os.environ["SWIN_BACKBONE_CACHE"] = cache
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        kc.forget(persisted=False)
        # Each rank sees other input sizes, hence other timings: rank 0 finds SDPA faster,
        # rank 1 the fused kernel. The signatures do not depend on the size.
        sdpa, fused = candidate("sdpa", "sdpa"), candidate("triton/warps8", warps=8)
        times = {sdpa.run: 1.0, fused.run: 2.0} if rank == 0 else {sdpa.run: 2.0, fused.run: 1.0}
        sigs = [kc.Signature("Test GPU sm_90", "bfloat16", "-", 7, heads, 32, True, False) for heads in (3, 6)]
        for sig in sigs:
            kc.decide(sig, lambda: [sdpa, fused], outputs, fixed_times(times))
        mine = {s.key(): kc.known(s).kernel for s in sigs}
        kc.DECISIONS.sync_after_forward("cuda", torch.bfloat16, True)  # end of the first training forward
        kc.DECISIONS.sync_after_forward("cuda", torch.bfloat16, True)  # later forwards: no collective
        # a signature met later on this rank only (valid_sizes): not timed, inherited
        late = sigs[0].__class__(**dict(sigs[0].__dict__, valid_sizes=True))
        if rank == 1:
            kc.decide(late, lambda: [sdpa, fused], outputs, lambda fn: pytest.fail("timed under distributed"))
        agreed = {s.key(): (kc.known(s).kernel, kc.known(s).source) for s in sigs}
        late_choice = kc.known(late)
        results[rank] = (mine, agreed, None if late_choice is None else (late_choice.kernel, late_choice.source))
    finally:
        dist.destroy_process_group()


def test_ranks_with_different_inputs_end_with_rank_0s_choices(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(2, port, str(tmp_path / "cache"), results), nprocs=2, join=True)
    (mine0, agreed0, _), (mine1, agreed1, late1) = results[0], results[1]
    assert set(mine0.values()) == {"sdpa"} and set(mine1.values()) == {"triton"}  # measured apart
    assert {k: v[0] for k, v in agreed0.items()} == {k: v[0] for k, v in agreed1.items()} == mine0
    assert {v[1] for v in agreed1.values()} == {"rank 0"}
    assert late1 == ("sdpa", "inherited")
