"""Every CPU kernel shipped for INT4 layers computes each row independently of the rows beside it, and the
--int4-kernel setting chooses among them by what the CPU has.

The rule (docs: README, "INT4 kernels"): random inputs of M = 1..17 rows, each row's result bitwise equal to
the same row multiplied alone. A kernel that fails it is dropped, not the rule loosened: drafts alone and
in a batch must stay identical.
"""

import ast
import subprocess
import sys
import threading

import pytest
import torch
from tiny_models import write_default_path_package

import attention_kernel
import draft_model
import int4
import kernel_build
import server_settings
import transformer

GROUP = 32


def random_int4_layer(in_features: int, out_features: int, seed: int, group: int = GROUP) -> int4.Int4Linear:
    """An Int4Linear from random GPTQ integers, scales and zeros (not a trained layer: the kernels do not care)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), generator=generator)
    zeros = torch.randint(0, 16, (in_features // group, out_features), generator=generator)
    scales = torch.rand(in_features // group, out_features, generator=generator) * 0.01 + 1e-3
    g_idx = torch.arange(in_features) // group
    packed = int4.gptq_pack(q, zeros, scales, g_idx)
    layer = int4.Int4Linear(in_features, out_features, group, bias=False)
    state = int4.Int4Linear.pack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], g_idx, "gptq")
    layer.load_state_dict(state)
    return layer


def available(name: str) -> bool:
    try:
        return int4.choose_cpu_kernel(name) == name
    except ValueError:
        return False


def few_rows_product(name: str, layer: int4.Int4Linear):
    """The product a kernel gives a decode step's (few) rows of `layer`."""
    if int4.CPU_KERNELS[name].weights == "packed":
        layer.use_cpu_kernel(name)
        return lambda x: layer(x.to(int4.INT4_KERNEL_DTYPE))
    dtype = int4.CPU_KERNELS[name].dtype
    weight = layer.dense_weight(dtype=torch.float32).to(dtype)  # dequantized once, as at load
    return lambda x: transformer.row_invariant_linear(x.to(dtype), weight)


def assert_rows_independent(product, in_features: int, seed: int, max_rows: int = 17) -> None:
    generator = torch.Generator().manual_seed(seed)
    for rows in range(1, max_rows + 1):
        x = torch.randn(rows, in_features, generator=generator)
        together = product(x)
        for row in range(rows):
            assert torch.equal(together[row], product(x[row : row + 1])[0]), f"row {row} of {rows}"


@pytest.mark.parametrize("name", list(int4.CPU_KERNELS))
def test_each_kernel_computes_every_row_as_it_computes_the_row_alone(name):
    if not available(name):
        pytest.skip(f"this CPU lacks {name}: it has {int4.cpu_description()}")
    layer = random_int4_layer(256, 512, seed=1)
    assert_rows_independent(few_rows_product(name, layer), 256, seed=2)


def test_int4pack_splits_a_large_layer_into_few_row_calls_with_the_same_bits():
    layer = random_int4_layer(1024, 16384, seed=3)  # 8 MiB packed: the size an lm_head's kernel calls are split at
    assert layer.packed_weight.numel() >= int4.LARGE_LAYER_BYTES
    assert_rows_independent(few_rows_product("int4pack", layer), 1024, seed=4, max_rows=3 * int4.KERNEL_ROWS + 1)


@pytest.mark.parametrize("with_lora", [False, True])
def test_a_prefills_complete_chunks_are_computed_as_each_chunk_alone(with_lora):
    """The many-row path: unpacked per call (the adapter merged in), in wide blocks of several chunks where the
    library keeps rows apart (int4.chunk_rows_matmul): six chunks are a wide block and two chunks."""
    layer = random_int4_layer(256, 512, seed=5)
    generator = torch.Generator().manual_seed(6)
    lora = (torch.randn(8, 256, generator=generator), torch.randn(512, 8, generator=generator) * 0.01)
    chunk = int4.DENSE_ROW_BLOCK
    x = torch.randn(6 * chunk + 5, 256, generator=generator).to(int4.INT4_KERNEL_DTYPE)
    for chunks in (1, 3, 6):
        dense_rows = chunks * chunk
        together = layer(x[:dense_rows], dense_rows, lora if with_lora else None)
        for c in range(chunks):
            rows = slice(c * chunk, (c + 1) * chunk)
            alone = layer(x[rows], chunk, lora if with_lora else None)
            assert torch.equal(together[rows], alone), f"chunk {c} of {chunks}"
    mixed = layer(x, 6 * chunk)  # complete chunks and a last chunk's rows in one call
    assert torch.equal(mixed[6 * chunk :], layer(x[6 * chunk :], 0))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wide_blocks_give_each_chunk_the_bits_it_gets_alone(dtype, threads):
    """chunk_rows_matmul's rows against each chunk's own product, for the model's layer shapes and the layouts
    the prefill passes (an unpacked weight, a Linear's transposed one)."""
    chunk, generator, saved = int4.DENSE_ROW_BLOCK, torch.Generator().manual_seed(7), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for K, N in ((576, 960), (576, 2048), (1536, 576)):
            weight = torch.randn(N, K, generator=generator).to(dtype)
            x = torch.randn(7 * chunk, K, generator=generator).to(dtype)  # a wide block and three chunks
            for b in (weight.t(), weight.t().contiguous()):
                out = x.new_empty(x.shape[0], N)
                int4.chunk_rows_matmul(x, b, out)
                for c in range(0, x.shape[0], chunk):
                    assert torch.equal(out[c : c + chunk], x[c : c + chunk] @ b), f"{K}x{N} rows {c}.."
    finally:
        torch.set_num_threads(saved)


def test_rows_take_chunk_blocks_where_the_library_mixes_them(monkeypatch):
    """Where the probe finds a wide block's rows differing from their chunks', only chunk-sized blocks are used."""
    blocks = []
    monkeypatch.setattr(int4, "wide_blocks_keep_rows", lambda K, b: False)
    monkeypatch.setattr(int4, "blockwise_matmul", lambda a, b, block, out: blocks.append((len(a), block)))
    x = torch.zeros(5 * int4.DENSE_ROW_BLOCK, 8)
    int4.chunk_rows_matmul(x, torch.zeros(8, 4), x.new_empty(len(x), 4))
    assert blocks == [(len(x), int4.DENSE_ROW_BLOCK)]


def test_int4_bf16dot_computes_the_dequantized_product():
    """Fast against naive: the kernel's rows equal x @ W^T in fp32 with W dequantized, up to the bf16 rounding of
    the result, on layers of every group size the kernel takes and on an lm_head's width; with one thread and
    with two the bits are the same (threads split the columns, never the sum)."""
    if not available("int4-bf16dot"):
        pytest.skip(f"int4-bf16dot is not available: this CPU has {int4.cpu_description()}")
    shapes = [(256, 512), (576, 960), (1536, 576), (512, 8192)]  # (in, out), one per group size
    for group, (in_features, out_features) in zip(int4.INT4_KERNEL_GROUP_SIZES, shapes):
        layer = random_int4_layer(in_features, out_features, seed=group, group=group)
        layer.use_cpu_kernel("int4-bf16dot")
        x = torch.randn(9, in_features, generator=torch.Generator().manual_seed(group)).to(torch.bfloat16)
        naive = x.float() @ layer.dense_weight(dtype=torch.float32).t()
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            fast = layer(x)
            torch.set_num_threads(1)
            alone = layer(x)
        finally:
            torch.set_num_threads(threads)
        torch.testing.assert_close(fast.float(), naive, rtol=2**-7, atol=2**-7 * naive.abs().max().item())
        assert torch.equal(alone, fast), f"group {group}: one thread and two differ"


def test_int4_bf16dot_adds_a_lora_side_product_to_each_row_on_its_own():
    """A LoRA adapter beside an int4-bf16dot layer rides in the kernel: each row's result is its own (alone
    against among 1-17 others), and equals the INT4 product plus x A^T B^T up to the bf16 rounding."""
    if not available("int4-bf16dot"):
        pytest.skip(f"int4-bf16dot is not available: this CPU has {int4.cpu_description()}")
    layer = random_int4_layer(576, 960, seed=11)
    layer.use_cpu_kernel("int4-bf16dot")
    generator = torch.Generator().manual_seed(12)
    lora_A, lora_B = torch.randn(48, 576, generator=generator) * 0.05, torch.randn(960, 48, generator=generator) * 0.05
    adapted = transformer.LoRALinear(layer, lora_A, lora_B, scale=2.0)
    adapted.prepare_fused_side()
    assert layer.fuses_lora and adapted.lora_Bt is not None
    assert_rows_independent(lambda x: adapted(x.to(torch.bfloat16)), 576, seed=13)
    x = torch.randn(9, 576, generator=generator).to(torch.bfloat16)
    naive = x.float() @ (layer.dense_weight(dtype=torch.float32) + 2.0 * lora_B @ lora_A).t()
    torch.testing.assert_close(adapted(x).float(), naive, rtol=2**-7, atol=2**-7 * naive.abs().max().item())
    layer.use_cpu_kernel("int4pack")
    with pytest.raises(RuntimeError, match="does not add a LoRA side product"):
        layer.kernel(x, (adapted.lora_A, adapted.lora_Bt))


def test_auto_takes_dense_bf16_where_amx_multiplies_bf16_then_int4_bf16dot_then_int4pack(monkeypatch):
    monkeypatch.setattr(int4, "bf16dot_build_problem", lambda: None)
    monkeypatch.setattr(int4, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}))
    assert int4.choose_cpu_kernel("auto") == "dense-bf16"
    assert int4.packed_cpu_kernel("auto") == "int4-bf16dot"  # what --weights packed runs there
    monkeypatch.setattr(int4, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert int4.choose_cpu_kernel("auto") == "int4-bf16dot"
    monkeypatch.setattr(int4, "bf16dot_build_problem", lambda: "no C++ compiler")
    assert int4.choose_cpu_kernel("auto") == "int4pack"
    monkeypatch.setattr(int4, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    monkeypatch.setattr(int4, "bf16dot_build_problem", lambda: None)
    assert int4.choose_cpu_kernel("auto") == "int4pack"


def test_a_forced_int4_bf16dot_that_cannot_be_built_is_refused_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(int4, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    monkeypatch.setattr(int4, "bf16dot_build_problem", lambda: "Ninja is required to load C++ extensions")
    with pytest.raises(server_settings.ConfigError) as refused:
        server_settings.ServerSettings(model_dir="model", device="cpu", int4_kernel="int4-bf16dot")
    message = str(refused.value)
    assert "\n" not in message and "Ninja is required" in message and "choose int4pack" in message
    with pytest.raises(draft_model.ModelLoadError, match="could not be built here"):
        draft_model.load_model(
            write_default_path_package(tmp_path / "package"), device="cpu", int4_kernel="int4-bf16dot"
        )


def test_a_build_waits_for_another_processes_lock_but_not_forever(tmp_path):
    """torch's build lock: wait while another process builds; a lock left by a killed build ends the wait
    with a reason naming the file (the kernel then falls back), where torch alone would wait forever."""
    assert kernel_build.wait_for_build_lock(tmp_path, wait_s=0.2) is None
    lock = tmp_path / "lock"
    lock.touch()
    problem = kernel_build.wait_for_build_lock(tmp_path, wait_s=0.3)
    assert str(lock) in problem and "delete it" in problem and "\n" not in problem
    threading.Timer(0.3, lock.unlink).start()  # a build that finishes while we wait
    assert kernel_build.wait_for_build_lock(tmp_path, wait_s=30) is None


def test_a_forced_kernel_the_cpu_lacks_is_refused_in_one_line_naming_what_it_has(monkeypatch):
    monkeypatch.setattr(int4, "cpu_flags", lambda: frozenset({"avx2"}))
    with pytest.raises(server_settings.ConfigError) as refused:
        server_settings.ServerSettings(model_dir="model", device="cpu", int4_kernel="dense-bf16")
    message = str(refused.value)
    assert "\n" not in message and "dense-bf16" in message and "avx512_bf16 or amx_bf16" in message
    assert "this CPU has avx2" in message


def test_an_unknown_kernel_lists_the_valid_ones():
    with pytest.raises(server_settings.ConfigError, match="auto, int4pack, int4-bf16dot, dense-bf16, dense-fp32"):
        server_settings.ServerSettings(model_dir="model", device="cpu", int4_kernel="onednn")
    with pytest.raises(ValueError, match="auto, int4pack, int4-bf16dot, dense-bf16, dense-fp32"):
        int4.choose_cpu_kernel("onednn")


def test_a_forced_dense_kernel_sets_weights_and_dtype_and_refuses_a_contradiction():
    settings = server_settings.ServerSettings(model_dir="model", device="cpu", int4_kernel="dense-fp32")
    assert (settings.int4_kernel, settings.weights, settings.dtype) == ("dense-fp32", "dequant", "float32")
    with pytest.raises(server_settings.ConfigError, match="runs --weights dequant, not packed"):
        server_settings.ServerSettings(model_dir="model", device="cpu", int4_kernel="dense-fp32", weights="packed")
    assert server_settings.ServerSettings(model_dir="model", device="cpu").weights == "auto"  # load_model chooses


def test_auto_loads_the_kernel_auto_chooses(tmp_path):
    """A GPTQ package loaded with every setting at auto runs the kernel int4.choose_cpu_kernel('auto') names,
    and describes it (the server's start-up line and /health carry describe())."""
    drafter = draft_model.load_model(write_default_path_package(tmp_path / "package"), device="cpu")
    described = drafter.describe()["kernel"]
    assert described["name"].split("+")[0] == int4.choose_cpu_kernel("auto")  # + int4pack for narrow layers
    assert described["cpu"] == int4.cpu_description()
    assert described["attention"] == attention_kernel.cpu_choice()


# Run in a process of its own, so that no other thread of the test session spends CPU time while it measures.
SECOND_THREAD_PROBE = """
import os, threading, time
import torch
import attention_kernel, int4

def other_threads_cpu_s():
    main, total = str(threading.get_native_id()), 0
    for tid in os.listdir("/proc/self/task"):
        if tid != main:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")

def second_thread_share(kernel, *arguments):
    kernel(*arguments)
    before, started = other_threads_cpu_s(), time.perf_counter()
    while time.perf_counter() - started < 1.0:
        kernel(*arguments)
    return (other_threads_cpu_s() - before) / (time.perf_counter() - started)

torch.set_num_threads(2)
generator = torch.Generator().manual_seed(0)
shares = {}
if int4.packed_cpu_kernel() == "int4-bf16dot":
    packed = torch.randint(0, 256, (8192, 288), dtype=torch.uint8, generator=generator)
    params = torch.randn(9, 8192, 2, generator=generator).bfloat16()
    x = torch.randn(16, 576, generator=generator).bfloat16()
    shares["int4-bf16dot"] = second_thread_share(torch.ops.draft_server.int4_bf16dot_mm, x, packed, params, 64)
if attention_kernel.wants_query_kernel("auto", torch.device("cpu"), torch.bfloat16):
    keys = torch.randn(16, 2, 512, 64, generator=generator).bfloat16()
    q = torch.randn(16, 4, 6, 64, generator=generator).bfloat16()
    positions = torch.arange(500, 504).repeat(16, 1)
    shares["query-attention"] = second_thread_share(
        attention_kernel.query_attention, q, keys, keys, torch.arange(16), positions
    )
print(shares)
"""


def test_the_cpu_kernels_run_on_the_threads_torch_is_given(repo_root):
    """With two torch threads, a second thread is at work while each C++ kernel runs (its CPU time during the
    calls): the kernels open OpenMP parallel regions, which at::parallel_for gives only when they are built with
    -fopenmp. Built without, every call ran on the calling thread alone. (How much the second thread saves is
    a benchmark's question: bench_kernels --threads 2.)"""
    result = subprocess.run(
        [sys.executable, "-c", SECOND_THREAD_PROBE], cwd=repo_root, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    shares = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    if not shares:
        pytest.skip(f"neither C++ kernel runs on this CPU: it has {int4.cpu_description()}")
    for kernel, share in shares.items():
        # A working (or waiting, spinning) second thread is busy most of the time; without one, about 1%.
        assert share > 0.15, f"{kernel}: other threads were busy {share:.0%} of the time (two torch threads)"
