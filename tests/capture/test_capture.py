"""``tsh.capture``: exact values against hand-written hooks, gradients unchanged, names,
dtypes, dynamic shapes, failures, the memory bound and the device path."""

from __future__ import annotations

import copy
import io
import json
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks.storage.io import LocalIO
from tests.fake_accelerator import CpuAsAccelerator


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, d: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def net(seed: int = 0, **kw: int) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


def batches(n: int, rows: int = 6, seq: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, seq, 8, generator=g) for _ in range(n)]


def reference(
    model: nn.Module, names: Sequence[str], data: list[torch.Tensor], *, backward: bool = True
) -> dict[str, list[torch.Tensor]]:
    """The tutorial's way: hooks that copy outputs (and output gradients) to a list."""
    got: dict[str, list[torch.Tensor]] = {}
    handles = []
    mods = dict(model.named_modules())
    for name in names:

        def fwd(m: nn.Module, a: Any, out: torch.Tensor, name: str = name) -> None:
            got.setdefault(f"{name}/output", []).append(out.detach().cpu().clone())
            if out.requires_grad:
                out.register_hook(
                    lambda g, name=name: got.setdefault(f"{name}/grad_output", []).append(g.clone())
                )

        handles.append(mods[name].register_forward_hook(fwd))
    for x in data:
        out = model(x)
        if backward:
            out.pow(2).mean().backward()
    for h in handles:
        h.remove()
    return got


def read(arr: Any) -> torch.Tensor:
    value = arr[...]
    t = torch.from_numpy(np.ascontiguousarray(value))
    stored = arr.attrs["dtype"]
    return t.view(getattr(torch, stored)) if stored in ("bfloat16",) else t


def train(model: nn.Module, data: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    for x in data:
        model(x).pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# --------------------------------------------------------------------- values
@pytest.mark.parametrize("chunk_bytes", ["4KiB", "8MiB"])
def test_outputs_and_gradients_equal_hand_written_hooks(store_url: str, chunk_bytes: str) -> None:
    data = batches(5)
    names = ["blocks.0", "blocks.1", "blocks.2"]
    ref = reference(net(), names, data)
    ref_grads = train(net(), data)
    model = net()
    with tsh.capture(
        model,
        store_url,
        modules="blocks.*",
        what=("output", "grad_output"),
        chunk_bytes=chunk_bytes,
    ) as cap:
        grads = train(model, data)
    assert sorted(cap.arrays) == sorted(ref)
    for name, values in ref.items():
        assert torch.equal(read(cap.arrays[name]), torch.cat(values)), name
    for name, g in ref_grads.items():  # capture changes no gradient
        assert torch.equal(grads[name], g), name
    attrs = cap.arrays["blocks.1/output"].attrs
    assert (attrs["module"], attrs["kind"], attrs["dtype"]) == ("blocks.1", "output", "float32")
    assert attrs["blocks"] == [[0, 0, 6, 5]]  # steps 0..4, 6 rows each
    assert cap.arrays["blocks.1/grad_output"].attrs["blocks"] == [[0, 0, 6, 5]]
    assert cap.stats.rows == 2 * 3 * 30 and cap.stats.failed_writes == 0


def test_plain_zarr_opens_the_arrays(tmp_path: Path) -> None:
    data = batches(3)
    model = net()
    ref = reference(net(), ["blocks.0"], data, backward=False)
    with torch.no_grad(), tsh.capture(model, str(tmp_path), modules="blocks.0", what="output"):
        for x in data:
            model(x)
    group = zarr.open_group(str(tmp_path), mode="r")
    arr = group["capture/blocks.0/output"]
    assert isinstance(arr, zarr.Array)
    assert arr.shape == (18, 5, 16) and arr.dtype == np.float32
    assert torch.equal(torch.from_numpy(arr[:]), torch.cat(ref["blocks.0/output"]))
    assert arr.metadata.codecs[-1].to_dict()["name"] == "crc32c"  # zarr verifies chunks


def test_inputs_keywords_tuples_and_dicts_name_the_rule(tmp_path: Path) -> None:
    class Many(nn.Module):
        def forward(
            self, a: torch.Tensor, b: torch.Tensor, *, scale: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, Any]]:
            return a * scale, {"sum": a + b, "none": None, "n": 3}

    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.many = Many()
            self.one = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y, d = self.many(x, x + 1, scale=torch.full((2, 4), 2.0))
            return self.one(y + d["sum"])

    model = Top()
    x = torch.randn(2, 4)
    with tsh.capture(
        model, str(tmp_path), modules=["many", "one"], what=("input", "output")
    ) as cap:
        model(x)
    got = {k: read(v) for k, v in cap.arrays.items()}
    assert sorted(got) == [
        "many/input.0",
        "many/input.1",
        "many/input.scale",
        "many/output.0",
        "many/output.1.sum",
        "one/input",
        "one/output",
    ]
    assert torch.equal(got["many/input.0"], x)
    assert torch.equal(got["many/input.1"], x + 1)
    assert torch.equal(got["many/output.0"], x * 2)
    assert torch.equal(got["many/output.1.sum"], x + (x + 1))


def test_grad_input_and_the_model_itself(tmp_path: Path) -> None:
    data = batches(2)
    ref: list[torch.Tensor] = []
    model = net()
    h = model.blocks[1].register_full_backward_hook(lambda m, gi, go: ref.append(gi[0].clone()))
    train(model, data)
    h.remove()
    model = net()
    with (
        tsh.capture(model, str(tmp_path), modules=None, what="output") as whole,
        tsh.capture(model, str(tmp_path / "g"), modules="blocks.1", what="grad_input") as cap,
    ):
        train(model, data)
    assert torch.equal(read(cap.arrays["blocks.1/grad_input"]), torch.cat(ref))
    assert list(whole.arrays) == ["root/output"]
    assert whole.arrays["root/output"].shape == (12, 5, 4)


def test_steps_count_forwards_and_can_be_set(tmp_path: Path) -> None:
    model = net()
    with torch.no_grad(), tsh.capture(model, str(tmp_path), modules="head", what="output") as cap:
        for x in batches(3):
            model(x)
        cap.step = 100
        for x in batches(2):
            model(x)
    assert cap.arrays["head/output"].attrs["blocks"] == [[0, 0, 6, 3], [100, 18, 6, 2]]
    with pytest.raises(tsh.ConfigError, match="step"):
        cap.step = -1


# --------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype", ["bfloat16", torch.float16, "float64"])
def test_dtype_casts_exactly_and_leaves_other_tensors_alone(
    tmp_path: Path, dtype: str | torch.dtype
) -> None:
    class Two(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 3, x.argmax(-1)

    model = nn.Sequential(Two())
    x = torch.randn(4, 6)
    target = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with tsh.capture(model, str(tmp_path), modules="0", what="output", dtype=dtype) as cap:
        model(x)
    floats, ints = cap.arrays["0/output.0"], cap.arrays["0/output.1"]
    assert floats.attrs["dtype"] == str(target).removeprefix("torch.")
    assert floats.attrs["source_dtype"] == "float32"
    assert torch.equal(read(floats), (x * 3).to(target))
    assert ints.attrs["dtype"] == "int64" and torch.equal(read(ints), x.argmax(-1))
    if target == torch.bfloat16:
        assert floats.dtype == np.uint16  # plain zarr sees the bits; attrs name the dtype


def test_bad_arguments_are_config_errors(tmp_path: Path) -> None:
    model = net()
    url = str(tmp_path)
    with pytest.raises(tsh.ConfigError, match=r"'blocks\.9\*' matches no module.*'blocks\.0'"):
        tsh.capture(model, url, modules=["blocks.*", "blocks.9*"], what="output")
    with pytest.raises(tsh.ConfigError, match=r"what=.*unknown: 'outputs'"):
        tsh.capture(model, url, modules="head", what="outputs")
    with pytest.raises(tsh.ConfigError, match="floating-point"):
        tsh.capture(model, url, modules="head", what="output", dtype="int8")
    with pytest.raises(tsh.ConfigError, match="min_bytes belong to offload"):
        tsh.capture(model, url, modules="head", what="output", min_bytes=0)
    with pytest.raises(tsh.ConfigError, match=r"capture\(max_inflight"):
        tsh.capture(model, url, modules="head", what="output", max_inflight="lots")
    with pytest.raises(tsh.ConfigError, match="temporary store"), tsh.open_store() as temp:
        tsh.capture(model, temp, modules="head", what="output")
    # Nothing was hooked by any of them.
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("url", ["tsh://127.0.0.1:7077", "tsh+unix:///tmp/x.sock"])
def test_the_daemon_is_refused_with_the_alternative(url: str) -> None:
    with pytest.raises(tsh.ConfigError, match=r"frees them when it ends.*s3://bucket/prefix"):
        tsh.capture(net(), url, modules="head", what="output")


# --------------------------------------------------------------- dynamic shapes
def test_one_array_per_row_shape(tmp_path: Path) -> None:
    model = net()
    seqs = [5, 7, 5, 3, 7]
    data = [torch.randn(2, s, 8) for s in seqs]
    ref = reference(net(), ["head"], data, backward=False)["head/output"]
    with torch.no_grad(), tsh.capture(model, str(tmp_path), modules="head", what="output") as cap:
        for x in data:
            model(x)
    arrays = cap.arrays
    assert sorted(arrays) == ["head/output", "head/output@3x4_float32", "head/output@7x4_float32"]
    assert torch.equal(read(arrays["head/output"]), torch.cat([ref[0], ref[2]]))
    assert torch.equal(read(arrays["head/output@7x4_float32"]), torch.cat([ref[1], ref[4]]))
    assert arrays["head/output@7x4_float32"].attrs["blocks"] == [[1, 0, 2, 1], [4, 2, 2, 1]]
    ds = tsh.CaptureDataset(str(tmp_path), "head/output", batch_size=4, flatten=True)
    tokens = torch.cat(list(ds))
    want = torch.cat([r.reshape(-1, 4) for r in ref])
    assert _sorted_rows(tokens) == _sorted_rows(want)


def _sorted_rows(t: torch.Tensor) -> list[tuple[float, ...]]:
    return sorted(map(tuple, t.tolist()))


def test_a_second_capture_appends_and_a_new_shape_leaves_the_array_alone(tmp_path: Path) -> None:
    model = net()
    data = batches(3, rows=5)
    ref = reference(net(), ["head"], data, backward=False)["head/output"]
    with torch.no_grad():
        # 5 rows of 80 B and chunks of 4 KiB: the first capture ends mid-chunk.
        with tsh.capture(model, str(tmp_path), modules="head", what="output", chunk_bytes="4KiB"):
            model(data[0])
        with tsh.capture(model, str(tmp_path), modules="head", what="output") as cap:
            model(data[1])
            model(data[2][:, :2])  # another row shape: its own array
            model(data[2])
    arr = cap.arrays["head/output"]
    assert torch.equal(read(arr), torch.cat(ref))
    assert arr.attrs["blocks"] == [[0, 0, 5, 1], [0, 5, 5, 1], [2, 10, 5, 1]]
    assert "head/output@2x4_float32" in cap.arrays


# --------------------------------------------------------------------- failures
class FailingIO(LocalIO):
    """A local root whose chunk writes fail as ``fail(path)`` says: half the bytes are
    written, then ENOSPC (a disk filling up mid-write)."""

    def __init__(self, root: str, fail: Callable[[str], bool]) -> None:
        super().__init__(root)
        self.fail = fail
        self.failures = 0

    def _write(self, path: str, parts: Any, trailer: Any) -> None:
        if "/c/" in path and self.fail(path):
            self.failures += 1
            data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
            super()._write(path, [b"\x7f" * (len(data) // 2)], None)
            raise OSError(28, "No space left on device", path)
        super()._write(path, parts, trailer)


def _with_io(cap: tsh.Capture, new: LocalIO) -> tsh.Capture:
    cap._writer.io = new
    return cap


def test_a_failed_write_keeps_training_going_and_hides_the_whole_block(tmp_path: Path) -> None:
    # Rows of 1600 B, chunks of 4 KiB: 2 rows a chunk; blocks of 3 rows.
    data = batches(6, rows=3, seq=100)
    ref = reference(net(), ["head"], data, backward=False)["head/output"]
    ref_grads = train(net(), data)
    model = net()
    failing = FailingIO(str(tmp_path), lambda p: p.split("/c/")[1].startswith("2/"))
    cap = _with_io(
        tsh.capture(model, str(tmp_path), modules="head", what="output", chunk_bytes="4KiB"),
        failing,
    )
    with pytest.warns(UserWarning, match=r"chunk 2 of capture/head/output failed.*continues"), cap:
        grads = train(model, data)  # training goes on
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    assert failing.failures == 1 and cap.stats.failed_writes == 1
    # Chunks 0-1 hold rows 0-3: block 0 (rows 0-2) is whole; block 1 (rows 3-5) is
    # not, though row 3 was written: the array shows block 0 only.
    arr = zarr.open_array(str(tmp_path / "capture/head/output"), mode="r")
    assert arr.shape == (3, 100, 4)
    assert torch.equal(torch.from_numpy(arr[:]), ref[0])
    assert cap.stats.rows_dropped == 18 - 3
    assert arr.attrs["blocks"] == [[0, 0, 3, 1]]


def test_a_failed_rewrite_never_damages_visible_rows(tmp_path: Path) -> None:
    data = batches(3, rows=1, seq=100)  # 2 rows a chunk
    ref = reference(net(), ["head"], data, backward=False)["head/output"]
    model = net()
    writes: list[str] = []

    def second_write_of_chunk_0(path: str) -> bool:
        writes.append(path)
        return len(writes) == 2

    failing = FailingIO(str(tmp_path), second_write_of_chunk_0)
    cap = _with_io(
        tsh.capture(model, str(tmp_path), modules="head", what="output", chunk_bytes="4KiB"),
        failing,
    )
    with torch.no_grad(), pytest.warns(UserWarning, match="failed"), cap:
        model(data[0])
        cap.flush()  # row 0 visible, in a partial chunk 0
        model(data[1])
        cap.flush()  # rewriting chunk 0 fails halfway
        model(data[2])
    arr = zarr.open_array(str(tmp_path / "capture/head/output"), mode="r")
    assert arr.shape == (1, 100, 4)
    assert torch.equal(torch.from_numpy(arr[:]), ref[0])  # crc32c verified by zarr
    assert not list((tmp_path / "capture/head/output/c").glob("*.tmp-*"))


# ------------------------------------------------------------------ memory bound
class SlowIO(LocalIO):
    def _write(self, path: str, parts: Any, trailer: Any) -> None:
        if "/c/" in path:
            time.sleep(0.01)
        super()._write(path, parts, trailer)


def test_host_memory_stays_within_max_inflight_and_tails_spill(tmp_path: Path) -> None:
    # 3 blocks x (output + grad_output) = 6 arrays; chunks of 8 KiB, 16 KiB allowed.
    data = batches(12, rows=4, seq=8)
    names = ["blocks.0", "blocks.1", "blocks.2"]
    ref = reference(net(), names, data)
    model = net()
    cap = tsh.capture(
        model,
        str(tmp_path),
        modules="blocks.*",
        what=("output", "grad_output"),
        chunk_bytes="8KiB",
        max_inflight="16KiB",
    )
    with _with_io(cap, SlowIO(str(tmp_path))):
        train(model, data)
    s = cap.stats
    assert s.peak_inflight_bytes <= 16 << 10
    assert s.spills > 0 and s.stall_s > 0
    for name, values in ref.items():  # tails written early were read back exactly
        assert torch.equal(read(cap.arrays[name]), torch.cat(values)), name


# ------------------------------------------------------------------ device path
def _idle(cap: tsh.Capture) -> None:
    cap._writer.inflight.wait_idle()


def test_accelerator_tensors_go_through_the_stager_and_leave_nothing_behind(
    tmp_path: Path,
) -> None:
    data = batches(4)
    ref = reference(net(), ["blocks.0", "head"], data)
    model = net()
    ops = CpuAsAccelerator(lazy=True, polls=1000)  # copies run only when waited for
    cap = tsh.capture(
        model, str(tmp_path), modules=["blocks.0", "head"], what=("output", "grad_output")
    )
    cap._writer.ops = ops
    with cap:
        for x in data:
            model(x).pow(2).mean().backward()
            _idle(cap)
            for arr in cap._writer._arrays.values():  # device tensors dropped once copied
                assert arr.tail is None or not arr.tail.copies
    assert ops.to_host_calls >= 4 * 4 and ops.allocations >= 1
    for name, values in ref.items():
        assert torch.equal(read(cap.arrays[name]), torch.cat(values)), name


@pytest.mark.cuda
def test_cuda_tensors_are_captured_exactly_and_freed(tmp_path: Path) -> None:
    data = batches(3)
    ref = reference(net(), ["blocks.1"], data)
    model = net().cuda()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with tsh.capture(
        model, str(tmp_path), modules="blocks.1", what=("output", "grad_output")
    ) as cap:
        for x in data:
            model(x.cuda()).pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before
    for name, values in ref.items():
        assert torch.equal(read(cap.arrays[name]), torch.cat(values)), name


# --------------------------------------------------------------- composition
def test_together_with_wrap_and_offload(tmp_path: Path) -> None:
    data = batches(3)
    names = ["blocks.0", "blocks.2"]
    ref = reference(net(), names, data)
    ref_grads = train(net(), data)
    model = net()
    hooks = tsh.wrap(model, "memory://", modules="blocks.*", min_bytes=0)
    try:
        with tsh.capture(
            model, str(tmp_path), modules=names, what=("output", "grad_output")
        ) as cap:
            grads = train(model, data)
            with tsh.offload("memory://", min_bytes=0) as outer:
                model(data[0]).pow(2).mean().backward()
    finally:
        tsh.unwrap(model)
    assert hooks.stats.tensors_offloaded > 0 and outer.stats.tensors_offloaded >= 0
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    for name, values in ref.items():
        got = read(cap.arrays[name])
        assert torch.equal(got[: len(values) * 6], torch.cat(values)), name


def test_activation_checkpointing_is_captured_once(tmp_path: Path) -> None:
    from torch.utils.checkpoint import checkpoint

    class Ckpt(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for b in self.blocks:
                h = checkpoint(b, h, use_reentrant=False)
            return self.head(h)

    data = batches(2)
    ref = reference(net(), ["blocks.1", "blocks.1.fc"], data)
    torch.manual_seed(0)
    model = Ckpt()
    with tsh.capture(
        model, str(tmp_path), modules=["blocks.1", "blocks.1.fc"], what=("output", "grad_output")
    ) as cap:
        train(model, data)
    for name, values in ref.items():
        assert torch.equal(read(cap.arrays[name]), torch.cat(values)), name


def test_the_model_still_copies_and_a_copy_captures_nothing(tmp_path: Path) -> None:
    model = net()
    x = batches(1)[0]
    with torch.no_grad(), tsh.capture(model, str(tmp_path), modules="head", what="output") as cap:
        twin = copy.deepcopy(model)
        buf = io.BytesIO()
        torch.save(model, buf)
        pickle.dumps(model)
        twin(x)  # hooks of a copy do nothing
        model(x)
    assert cap.arrays["head/output"].shape[0] == 6
    assert cap.stats.blocks == 1
    assert not model.head._forward_hooks  # removed on exit


def test_remove_is_idempotent_and_late_gradients_are_counted(tmp_path: Path) -> None:
    model = net()
    cap = tsh.capture(model, str(tmp_path), modules="head", what="grad_output")
    loss = model(batches(1)[0]).sum()
    cap.remove()
    cap.remove()
    loss.backward()  # after the capture ended: nothing is written
    assert cap.stats.rows_dropped == 6 and cap.arrays == {}


def test_scalars_are_rows_and_unsupported_tensors_are_skipped(tmp_path: Path) -> None:
    class Odd(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.sum(), x.to_sparse()

    model = nn.Sequential(Odd())
    with tsh.capture(model, str(tmp_path), modules="0", what="output") as cap:
        for i in range(3):
            model(torch.full((2, 2), float(i)))
    assert torch.equal(read(cap.arrays["0/output.0"]), torch.tensor([0.0, 4.0, 8.0]))
    assert cap.stats.skipped == 3


def test_hooks_on_several_threads(tmp_path: Path) -> None:
    models = [net(seed=i) for i in range(3)]
    data = batches(4)
    refs = [reference(net(seed=i), ["head"], data, backward=False) for i in range(3)]
    caps = [
        tsh.capture(m, str(tmp_path / str(i)), modules="head", what="output", max_inflight="8KiB")
        for i, m in enumerate(models)
    ]

    def run(m: nn.Module) -> None:
        with torch.no_grad():
            for x in data:
                m(x)

    threads = [threading.Thread(target=run, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for cap, ref in zip(caps, refs, strict=True):
        cap.remove()
        assert torch.equal(read(cap.arrays["head/output"]), torch.cat(ref["head/output"]))


def test_gradient_accumulation_keeps_each_forwards_step(tmp_path: Path) -> None:
    model = net()
    a, b = batches(2)
    with tsh.capture(
        model, str(tmp_path), modules="head", what=("grad_output", "grad_input")
    ) as cap:
        loss = model(a).sum() + model(b).sum()  # two forwards, one backward
        loss.backward()
    # Each output's gradient carries the step of the forward that made it...
    assert _steps(cap.arrays["head/grad_output"]) == [0, 1]
    # ... and grad_input (a module backward hook) the step of the latest forward.
    assert _steps(cap.arrays["head/grad_input"]) == [1, 1]


def _steps(arr: Any) -> list[int]:
    """The step of every block of ``arr``, in step order."""
    return sorted(s + i for s, _, _, n in arr.attrs["blocks"] for i in range(n))


def test_config_sets_the_pipeline_and_torch_warns_for_grad_input_without_inputs(
    tmp_path: Path,
) -> None:
    model = net()
    cap = tsh.capture(
        model,
        str(tmp_path),
        modules="inp",
        what="grad_input",
        config={"pipeline": {"max_inflight": "1MiB", "writer_threads": 3}},
    )
    inflight = cap._writer.inflight
    assert inflight.max_inflight == 1 << 20 and inflight.pool.threads == 3
    with cap, pytest.warns(UserWarning, match="no inputs require gradients"):
        model(batches(1)[0]).sum().backward()  # the input of `inp` needs no gradient
    assert cap.arrays == {}


def test_a_dropped_capture_still_writes_what_it_took(tmp_path: Path) -> None:
    model = net()
    with torch.no_grad():
        cap = tsh.capture(model, str(tmp_path), modules="head", what="output")
        model(batches(1)[0])
        del cap  # never removed: collected
    assert not model.head._forward_hooks
    arr = zarr.open_array(str(tmp_path / "capture/head/output"), mode="r")
    assert arr.shape == (6, 5, 4)


FORK_SCRIPT = """
import os, sys, torch, zarr
import tensorstore_hooks as tsh
root = sys.argv[1]
model = torch.nn.Sequential(torch.nn.Linear(4, 4))
cap = tsh.capture(model, root, modules="0", what="output")
with torch.no_grad():
    model(torch.ones(3, 4))
    pid = os.fork()
    if pid == 0:              # a child running a copy of the model, then exiting normally
        model(torch.ones(5, 4))
        sys.exit(0)           # atexit runs: the child must write nothing
    os.waitpid(pid, 0)
    print(os.path.exists(root + "/capture"))   # nothing written yet, by anyone
    model(torch.ones(2, 4))
cap.remove()
print(zarr.open_array(root + "/capture/0/output", mode="r").shape[0])
"""


def test_a_forked_child_writes_nothing(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert proc.stdout.split() == ["False", "5"]  # 3 + 2 rows of the parent; none of the child


class SlowChunksIO(LocalIO):
    """A local root whose chunk writes take ``delay_s`` each (a slow disk), counting the
    documents of ``array`` it replaces."""

    def __init__(self, root: str, array: str, delay_s: float) -> None:
        super().__init__(root)
        self.array = array
        self.delay_s = delay_s
        self.documents = 0

    def write(self, path: str, parts: Sequence[Any]) -> None:
        if "/c/" in path:
            time.sleep(self.delay_s)
        super().write(path, parts)

    def replace(self, src: str, dst: str) -> None:
        super().replace(src, dst)
        if dst == f"{self.array}/zarr.json":
            self.documents += 1


def test_streaming_writes_replace_the_document_at_most_every_commit_every_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A document costs two fsyncs: while chunk writes stream in, ``zarr.json`` is
    replaced once per ``COMMIT_EVERY_S``, not once per chunk, and the last write to
    finish shows every row without a flush (NOTE [ Capture writes ] rule 4)."""
    from tensorstore_hooks.capture import _writer

    monkeypatch.setattr(_writer, "COMMIT_EVERY_S", 3600.0, raising=False)
    model = nn.Sequential(nn.Identity())
    io = SlowChunksIO(str(tmp_path), "capture/0/output", delay_s=0.02)
    cap = tsh.capture(
        model, str(tmp_path), modules="0", what="output", chunk_bytes="4KiB", writer_threads=4
    )
    cap._writer.io = io
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(64, 16, generator=g) for _ in range(48)]  # one 4 KiB chunk each
    with torch.no_grad():
        for x in rows:
            model(x)
    cap._writer.inflight.wait_idle()  # every chunk written; no flush
    doc = json.loads((tmp_path / "capture/0/output/zarr.json").read_text())
    assert doc["shape"] == [48 * 64, 16]  # the last write to finish committed
    # The first commit (none before it) and the last; none per chunk in between.
    assert io.documents <= 3, f"{io.documents} documents for 48 chunks"
    cap.remove()
    arr = zarr.open_array(str(tmp_path / "capture/0/output"), mode="r")
    assert torch.equal(torch.from_numpy(arr[:]), torch.cat(rows))
