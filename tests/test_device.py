"""load(..., device=...): which device a load goes to, and the staging ring that feeds a GPU.

This machine has no GPU. The CPU semantics run for real; the GPU path runs end to end against a
stand-in device (`FakeTransfer`: device buffers are CPU tensors, copies synchronous, every
allocation counted) with torch.cuda.is_available/device_count patched. What cannot run here:
pinned allocation, non-blocking copies and CUDA events (`_CudaTransfer`)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from partc.errors import CheckpointError, LaunchError, PartcError
from partc.runtime import device as device_module
from partc.runtime._engine.selection import TensorSelection
from partc.runtime.checkpoint import open_checkpoint
from partc.runtime.device import StagingRing, resolve_device, stage_to_device

from support import HF, ROOT, checkpoint_tensors, compile_and_import

LLAMA = HF / "llama"
PHI3 = HF / "phi3"


class FakeTransfer:
    """A stand-in device: destination buffers are CPU tensors; every allocation is recorded."""

    def __init__(self) -> None:
        self.staging_sizes: list[int] = []
        self.destination_sizes: list[int] = []
        self.copies: list[int] = []
        self.waits = 0
        self.lanes = 0
        self.staging_buffers: list[torch.Tensor] = []

    def staging(self, nbytes):
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.staging_sizes.append(nbytes)
        self.staging_buffers.append(buffer)
        return buffer

    def destination(self, nbytes):
        self.destination_sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def lane(self):
        self.lanes += 1
        return self.lanes

    def copy(self, destination, source, lane):
        # the source must be a slice of a ring buffer: staging never allocates anything else
        assert any(source.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                   for b in self.staging_buffers)
        assert 1 <= lane <= self.lanes
        destination.copy_(source)
        self.copies.append(source.numel())
        return len(self.copies)

    def wait(self, handle):
        self.waits += 1


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch reports two CUDA devices; the load's device side is a FakeTransfer."""
    fake = FakeTransfer()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(device_module, "transfer_for", lambda device: fake)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return fake


def _reference_slices(state, reference):
    """Each loaded tensor's expected value: the safetensors tensor cut by the rank's layout."""
    out = {}
    for layout in state.layout.tensors:
        axis, ranges = layout.selection
        whole = reference[layout.target]
        out[layout.target] = whole if axis is None else np.concatenate(
            [np.take(whole, np.arange(a, b), axis=axis) for a, b in ranges], axis=axis)
    return out


def test_device_cpu_gives_torch_tensors_equal_to_the_safetensors_slices(tmp_path):
    _, package = compile_and_import(None, LLAMA / "config.json", tmp_path / "b", tp=2)
    reference = checkpoint_tensors(LLAMA)
    state = package.load(LLAMA, rank=1, device="cpu")
    expected = _reference_slices(state, reference)
    assert list(state.tensors) == list(expected)
    for name, tensor in state.tensors.items():
        assert isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu", name
        np.testing.assert_array_equal(tensor.numpy(), expected[name], err_msg=name)
    # the rank module takes it too; framework='torch' without a device is the CPU here
    module_state = package.rank_module(1).load(LLAMA, device=torch.device("cpu"))
    assert all(t.device.type == "cpu" for t in module_state.tensors.values())
    default = package.load(LLAMA, rank=1, framework="torch")
    assert all(t.device.type == "cpu" for t in default.tensors.values())


def test_device_none_without_a_gpu_is_the_cpu_and_ignores_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_default_device_with_a_gpu_is_cuda_local_rank(fake_gpu, monkeypatch):
    assert resolve_device(None) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device(None) == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)  # an explicit index wins
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(LaunchError, match=r"LOCAL_RANK=2 names CUDA device 2, but torch "
                                              r"sees 2 CUDA device\(s\)"):
        resolve_device(None)
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(LaunchError, match=r"LOCAL_RANK='one' is not an integer"):
        resolve_device(None)


@pytest.mark.parametrize(("device", "message"), [
    ("gpu0", r"device must be None, 'cpu', 'cuda' or 'cuda:N' .*found 'gpu0'"),
    ("cuda:x", r"device must be None, 'cpu', 'cuda' or 'cuda:N' .*found 'cuda:x'"),
    (3.5, r"device must be None, .*found 3.5"),
    ("meta", r"partc loads to the CPU or a CUDA device; device 'meta' is of type 'meta'"),
    ("cuda:0", r"device 'cuda:0' asked for, but torch .* sees no CUDA device"),
])
def test_bad_devices_are_refused_by_name(device, message, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PartcError, match=message):
        resolve_device(device)


def test_a_missing_cuda_index_and_contradictory_options_are_refused(fake_gpu, tmp_path):
    with pytest.raises(LaunchError, match=r"device 'cuda:5' asked for, but torch sees 2 "
                                              r"CUDA device\(s\) \(cuda:0..cuda:1\)"):
        resolve_device("cuda:5")
    _, package = compile_and_import(None, LLAMA / "config.json", tmp_path / "b", tp=2)
    with pytest.raises(CheckpointError, match=r"device='cpu' places torch tensors, but "
                                              r"framework is 'numpy'"):
        package.load(LLAMA, rank=0, device="cpu", framework="numpy")
    with pytest.raises(LaunchError, match=r"zero_copy=True cannot follow"):
        package.load(LLAMA, rank=0, device="cuda:0", zero_copy=True)
    with pytest.raises(LaunchError, match=r"zero_copy='private' cannot follow"):
        package.load(LLAMA, rank=0, device="cuda:0", zero_copy="private")
    with pytest.raises(LaunchError, match=r"staging_bytes sizes the host ring of a load to "
                                              r"a CUDA device"):
        package.load(LLAMA, rank=0, device="cpu", staging_bytes=1 << 20)


@pytest.mark.parametrize(("model", "tp", "ring"), [
    (LLAMA, 2, 1 << 20),   # every tensor in one block
    (LLAMA, 2, 512),       # blocks of rows, and rows cut further (a 1 KiB vocabulary row)
    (PHI3, 2, 96),         # fused-segment rows (several ranges) and column slices, cut small
])
def test_a_gpu_load_stages_through_the_ring_and_equals_the_safetensors_slices(
        fake_gpu, tmp_path, monkeypatch, model, tp, ring):
    _, package = compile_and_import(None, model / "config.json", tmp_path / "b", tp=tp)
    reference = checkpoint_tensors(model)

    def no_host_arrays(*_args, **_kwargs):
        raise AssertionError("a staged load allocated a host array outside the ring")

    monkeypatch.setattr("partc.runtime._engine.reader.empty_array", no_host_arrays)
    state = package.load(model, rank=1, device="cuda:1", staging_bytes=ring)
    expected = _reference_slices(state, reference)
    assert list(state.tensors) == list(expected)
    for name, tensor in state.tensors.items():
        assert tensor.dtype == torch.float32 and tuple(tensor.shape) == expected[name].shape
        np.testing.assert_array_equal(tensor.numpy(), expected[name], err_msg=name)
    # host memory: two staging buffers per reader thread, ring/(2 x threads) bytes each,
    # together never more than the ring or the shard (never a second full copy), allocated
    # once and reused
    total = sum(layout.local_bytes for layout in state.layout.tensors)
    threads = fake_gpu.lanes
    assert 1 <= threads <= 8 and len(fake_gpu.staging_sizes) <= 2 * threads
    assert all(size == min(ring, total) // (2 * threads) for size in fake_gpu.staging_sizes)
    assert sum(fake_gpu.staging_sizes) <= min(ring, total)
    assert max(fake_gpu.copies) <= ring // (2 * threads)
    assert sum(fake_gpu.copies) == total == sum(fake_gpu.destination_sizes)
    if ring < 1024:
        assert len(fake_gpu.copies) > len(state.tensors)  # tensors were cut into blocks
        assert fake_gpu.waits > 0  # a buffer was reused only after its copy was waited for


def test_a_gpu_load_converts_dtype_on_the_device(fake_gpu, tmp_path):
    _, package = compile_and_import(None, LLAMA / "config.json", tmp_path / "b", tp=2)
    state = package.load(LLAMA, rank=0, device="cuda", dtype="bfloat16", staging_bytes=4096)
    reference = _reference_slices(state, checkpoint_tensors(LLAMA))
    for name, tensor in state.tensors.items():
        assert tensor.dtype == torch.bfloat16, name
        expected = torch.from_numpy(reference[name]).to(torch.bfloat16)
        assert torch.equal(tensor, expected), name


def test_the_ring_waits_for_a_buffer_before_refilling_it():
    fake = FakeTransfer()
    ring = StagingRing(fake, 64, lane=fake.lane())
    destination = torch.empty(96, dtype=torch.uint8)
    for block in range(3):
        index, buffer = ring.acquire(32)
        buffer[:] = block
        ring.submit(index, destination[block * 32:(block + 1) * 32], 32)
    ring.drain()
    assert fake.staging_sizes == [32, 32] and fake.waits == 3  # one reuse + two drained
    assert destination.tolist() == [0] * 32 + [1] * 32 + [2] * 32


def test_staging_bytes_must_be_a_positive_integer(tmp_path):
    from partc.runtime.checkpoint import open_checkpoint

    with pytest.raises(LaunchError, match=r"staging_bytes must be an integer of at least 2"):
        stage_to_device(open_checkpoint(LLAMA), [], "cuda:0", staging_bytes=1,
                        transfer=FakeTransfer())


_BLOCK_TORCH = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, Refuse())
sys.path.insert(0, sys.argv[1])
import partc.runtime
from partc.errors import PartcError
package = __import__(sys.argv[2])
state = package.load(sys.argv[3], rank=1)
print(len(state.tensors), type(next(iter(state.tensors.values()))).__name__)
print(package.topology().world_size, package.launch_position().rank)
from partc.runtime.dtensor import to_dtensors
for call in (lambda: package.load(sys.argv[3], rank=1, device="cpu"),
             lambda: package.load(sys.argv[3], rank=1, framework="torch"),
             lambda: package.process_groups(),
             lambda: to_dtensors(state, None)):
    try:
        call()
    except PartcError as error:
        print("refused:", error)
assert "torch" not in sys.modules
"""


def test_the_core_loads_without_torch_and_names_the_extra_when_torch_is_asked_for(tmp_path):
    plan, _ = compile_and_import(None, LLAMA / "config.json", tmp_path / "b", tp=2)
    from partc.emit.render import package_name

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", _BLOCK_TORCH, str(tmp_path / "b"),
                           package_name(plan), str(LLAMA)], capture_output=True, text=True,
                          timeout=60, env={**env, "RANK": "1", "WORLD_SIZE": "2"}, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].endswith(" ndarray") and int(lines[0].split()[0]) > 0
    assert lines[1] == "2 1"
    refusals = lines[2:]
    assert len(refusals) == 4
    for line in refusals:
        assert "needs torch, which is not installed" in line
        assert "pip install 'partc[torch]'" in line
    assert "device=" in refusals[0] and "framework='torch'" in refusals[1]
    assert "process_groups()" in refusals[2] and "to_dtensors()" in refusals[3]


@pytest.mark.parametrize("shape", [(6, 5, 4), (3, 10), (17,), (2, 3, 4, 5)])
def test_blocks_of_any_selection_fill_the_local_tensor_in_c_order(shape):
    from partc.runtime._engine.selection import TensorSelection
    from partc.runtime.device import _pieces, _source_views

    whole = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    for axis in range(len(shape)):
        n = shape[axis]
        for ranges in (((0, n),), ((1, n),), ((0, 1), (n - 1, n)), ((n // 2, n), (0, 1))):
            selection = TensorSelection(axis=axis, ranges=ranges)
            expected = np.concatenate([np.take(whole, np.arange(a, b), axis=axis)
                                       for a, b in ranges], axis=axis)
            for limit in (4, 12, 40, 1 << 20):
                views, view_axis = _source_views(whole, selection)
                flat = np.full(expected.size, 0xFFFFFFFF, dtype=np.uint32)
                for first, part, part_axis in _pieces(views, view_axis, 0, limit):
                    block = list(part[0].shape)
                    block[part_axis] = sum(p.shape[part_axis] for p in part)
                    assert np.prod(block) * 4 <= max(limit, 4)
                    target = flat[first:first + int(np.prod(block))].reshape(block)
                    np.concatenate(part, axis=part_axis, out=target)
                np.testing.assert_array_equal(flat.view(np.float32).reshape(expected.shape),
                                              expected, err_msg=f"{shape} {axis} {ranges} {limit}")


@pytest.mark.parametrize("ring", [1 << 20, 96])  # whole tensors; blocks and rows cut small
def test_a_gpu_load_verifies_digests_on_the_staging_blocks(fake_gpu, tmp_path, ring):
    # verify="digest" on a device load: each tensor is hashed as its blocks pass through the
    # host ring, in C order, so the digests equal hashlib's over the safetensors slices
    import hashlib
    import shutil
    import struct

    from partc.errors import PartcErrors

    plan, package = compile_and_import(None, PHI3 / "config.json", tmp_path / "b", tp=2,
                                       checkpoint=PHI3, digests=True)
    reference = checkpoint_tensors(PHI3)
    ckpt = open_checkpoint(PHI3)
    state = package.load(PHI3, rank=1, device="cuda:1", staging_bytes=ring, verify="digest")
    expected = _reference_slices(state, reference)
    for name, tensor in state.tensors.items():
        np.testing.assert_array_equal(tensor.numpy(), expected[name], err_msg=name)
    found: dict[str, str] = {}
    requests = [(t.target, TensorSelection(axis=t.selection[0], ranges=t.selection[1]))
                for t in state.layout.tensors]
    stage_to_device(ckpt, requests, "cuda:1", staging_bytes=ring, transfer=FakeTransfer(),
                    digests=found)
    assert found == {name: hashlib.sha256(np.ascontiguousarray(want).tobytes()).hexdigest()
                     for name, want in expected.items()}
    # one payload byte flipped (header untouched): the device load names the tensor
    copy = tmp_path / "ck"
    shutil.copytree(PHI3, copy)
    target = next(t.target for t in state.layout.tensors if t.selection[0] == 1)  # a column slice
    raw = bytearray((copy / "model.safetensors").read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    header, entry = ckpt.tensor(target)
    rows, cols = entry.shape
    axis, ranges = next(t.selection for t in state.layout.tensors if t.target == target)
    item = entry.nbytes // (rows * cols)
    raw[header.data_start + entry.begin + (rows // 2 * cols + ranges[0][0]) * item] ^= 0x40
    (copy / "model.safetensors").write_bytes(bytes(raw))
    package.load(copy, rank=1, device="cuda:1", staging_bytes=ring)  # unverified: it loads
    with pytest.raises((CheckpointError, PartcErrors)) as caught:
        package.load(copy, rank=1, device="cuda:1", staging_bytes=ring, verify="digest")
    errors = caught.value.errors if isinstance(caught.value, PartcErrors) else [caught.value]
    assert [e.tensor for e in errors] == [target]
    assert "does not match its digest in the build's plan" in errors[0].message


@pytest.mark.parametrize("workers", [1, 3, 8])
def test_reader_threads_each_fill_their_own_buffers_and_lane(tmp_path, workers):
    # several reader threads stage at once: each takes blocks in turn, fills its own two
    # buffers and copies on its own lane; the result is the safetensors slices whatever the
    # interleaving, and the ring's total stays what was asked for
    plan, package = compile_and_import(None, PHI3 / "config.json", tmp_path / "b", tp=2)
    reference = checkpoint_tensors(PHI3)
    fake = FakeTransfer()
    ckpt = open_checkpoint(PHI3)
    table = package.load(PHI3, rank=1)  # the host load: its layout names the selections
    requests = [(t.target, TensorSelection(axis=t.selection[0], ranges=t.selection[1]))
                for t in table.layout.tensors]
    found: dict[str, str] = {}
    tensors, stats = stage_to_device(ckpt, requests, "cuda:0", staging_bytes=4096,
                                     transfer=fake, workers=workers, digests=found)
    expected = _reference_slices(table, reference)
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(tensor.numpy(), expected[name], err_msg=name)
    assert stats.lanes == fake.lanes == workers
    assert stats.buffers == len(fake.staging_sizes) <= 2 * workers
    assert set(fake.staging_sizes) == {4096 // (2 * workers)}
    assert stats.staged_bytes == sum(fake.copies) == sum(t.local_bytes
                                                         for t in table.layout.tensors)
    import hashlib

    assert found == {name: hashlib.sha256(np.ascontiguousarray(want).tobytes()).hexdigest()
                     for name, want in expected.items()}


def test_a_failing_copy_in_one_thread_stops_the_load_with_its_error(tmp_path):
    # a copy that fails in one reader thread: the load raises that error (the other threads
    # stop at their next block), it does not hang or return a partial state
    _, package = compile_and_import(None, PHI3 / "config.json", tmp_path / "b", tp=2)
    table = package.load(PHI3, rank=0)
    requests = [(t.target, TensorSelection(axis=t.selection[0], ranges=t.selection[1]))
                for t in table.layout.tensors]

    class Failing(FakeTransfer):
        def copy(self, destination, source, lane):
            if len(self.copies) == 5:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return super().copy(destination, source, lane)

    failing = Failing()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        stage_to_device(open_checkpoint(PHI3), requests, "cuda:0", staging_bytes=1024,
                        transfer=failing, workers=4)
    assert len(failing.copies) < len(requests)


def test_one_run_blocks_are_read_with_pread_and_a_short_read_names_the_tensor(tmp_path,
                                                                                monkeypatch):
    # whole tensors and row ranges are read into the ring with pread (no mapping touched); a
    # file that ends early meanwhile is a CheckpointError naming the tensor, never SIGBUS
    _, package = compile_and_import(None, LLAMA / "config.json", tmp_path / "b", tp=2)
    table = package.load(LLAMA, rank=0)
    requests = [(t.target, TensorSelection(axis=t.selection[0], ranges=t.selection[1]))
                for t in table.layout.tensors]
    reads = []
    real = os.preadv

    def counting(fd, buffers, offset):
        reads.append(sum(len(b) for b in buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(device_module.os, "preadv", counting)
    tensors, stats = stage_to_device(open_checkpoint(LLAMA), requests, "cuda:0",
                                     transfer=FakeTransfer(), workers=2)
    expected = _reference_slices(table, checkpoint_tensors(LLAMA))
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(tensor.numpy(), expected[name], err_msg=name)
    one_run = sum(t.local_bytes for t in table.layout.tensors if t.selection[0] in (None, 0))
    assert 0 < sum(reads) == one_run < stats.staged_bytes  # column slices were gathered
    monkeypatch.setattr(device_module.os, "preadv", lambda fd, buffers, offset: 0)
    with pytest.raises(CheckpointError, match=r"model.safetensors ended at byte \d+ while "
                       r"reading `[^`]+`, which needs \d+ bytes more") as caught:
        stage_to_device(open_checkpoint(LLAMA), requests, "cuda:0", transfer=FakeTransfer())
    assert caught.value.tensor in dict(requests)
