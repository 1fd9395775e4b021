"""Failures and timeouts surface fast, on every rank, with messages that say what to do."""

import threading
import time

import pytest
import torch
from usc.runtime.errors import CollectiveError, CollectiveTimeout
from usc.runtime.mesh import run_in_threads, simulated_meshes


def test_missing_rank_times_out_with_a_clear_message():
    meshes = simulated_meshes(("dp", "tp"), (1, 2), timeout=0.5)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        meshes[0].comm("tp").all_reduce(torch.ones(2))  # rank 1 never arrives
    assert time.monotonic() - start < 2.0
    message = str(info.value)
    for part in ["rank 0", "all-reduce", "'tp'", "group ranks (0, 1)", "timeout 0.5s", "[1] never arrived"]:
        assert part in message, part
    assert "raise timeout=SECONDS in the plan" in message and "other ranks' logs" in message


def test_missing_sender_times_out():
    meshes = simulated_meshes(("pp",), (2,), timeout=0.3)
    with pytest.raises(CollectiveTimeout, match="send/recv.*message #0 from group rank 0"):
        meshes[1].comm("pp").recv(torch.empty(2), 0)


def test_a_timeout_aborts_the_group_for_the_others():
    meshes = simulated_meshes(("tp",), (3,), timeout=0.3)

    def rank(mesh):
        if mesh.rank == 2:
            time.sleep(0.6)  # arrives after the others timed out
        return mesh.comm("tp").all_reduce(torch.ones(1))

    with pytest.raises(CollectiveError):
        run_in_threads(meshes, rank, timeout=5.0)


def test_one_rank_raising_fails_the_run_fast_with_that_ranks_error():
    meshes = simulated_meshes(("dp", "tp"), (2, 2), timeout=30.0)  # long: abort must wake them

    def rank(mesh):
        if mesh.rank == 2:
            raise ValueError("bad batch on rank 2")
        mesh.comm("tp").all_reduce(torch.ones(1))
        mesh.comm("dp").all_reduce(torch.ones(1))

    start = time.monotonic()
    with pytest.raises(ValueError, match="bad batch on rank 2") as info:
        run_in_threads(meshes, rank, timeout=30.0)
    assert time.monotonic() - start < 2.0
    assert "simulated rank 2" in "".join(getattr(info.value, "__notes__", []))


def test_peers_of_a_failed_rank_get_a_collective_error_naming_it():
    meshes = simulated_meshes(("tp",), (2,), timeout=30.0)
    errors = []

    def peer():
        try:
            meshes[0].comm("tp").all_gather(torch.ones(1), 0)
        except CollectiveError as exc:
            errors.append(exc)

    thread = threading.Thread(target=peer)
    thread.start()
    time.sleep(0.1)
    meshes[1].abort("simulated rank 1 failed first: OOM")
    thread.join(2.0)
    assert not thread.is_alive()
    assert "rank 0: all-gather over mesh axis 'tp'" in str(errors[0]) and "OOM" in str(errors[0])


def test_run_in_threads_deadline_reports_hung_ranks():
    meshes = simulated_meshes(("tp",), (2,), timeout=60.0)
    stop = threading.Event()

    def rank(mesh):
        if mesh.rank == 1:
            stop.wait(5.0)  # stuck in 'compute', not in a collective
        return mesh.rank

    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"simulated ranks \[1\] did not finish"):
        run_in_threads(meshes, rank, timeout=0.5)
    stop.set()
    assert time.monotonic() - start < 2.0


def _raised_by_a_launch(exc: BaseException) -> BaseException:
    from usc.runtime.comm import solo_comm

    def launch():
        raise exc

    with pytest.raises(BaseException) as info:
        solo_comm("tp", global_rank=0, timeout=1.0)._guard("all-reduce", launch)
    return info.value


@pytest.mark.parametrize("exc, kind", [
    (RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4711"), CollectiveError),
    (torch.distributed.DistBackendError("NCCL error: unhandled system error"), CollectiveError),
    (ConnectionResetError(104, "Connection reset by peer"), CollectiveError),
    (RuntimeError("Timed out waiting 300ms for recv operation to complete"), CollectiveTimeout),
    (TimeoutError("no completion within 5s"), CollectiveTimeout),
    # mentions a timeout setting without anything having timed out
    (RuntimeError("process group created with timeout=1800s has no backend for device 'meta'"), CollectiveError),
])
def test_transfer_failures_become_collective_errors_of_the_right_kind(exc, kind):
    error = _raised_by_a_launch(exc)
    assert type(error) is kind and error.__cause__ is exc
    assert "rank 0: all-reduce over mesh axis 'tp'" in str(error)


@pytest.mark.parametrize("exc", [ValueError("all_reduce: dim 3 is out of range"), TypeError("expected Tensor"),
                                 NotImplementedError("reduce op 'avg' on gloo"), KeyError("tp")])
def test_a_local_bug_inside_a_launch_is_not_called_a_collective_error(exc):
    assert _raised_by_a_launch(exc) is exc


def test_simulated_ranks_run_backward_on_their_own_thread():
    """On a GPU, autograd runs backward on one worker thread per device: simulated ranks sharing
    cuda:0 would queue their backward there, and a collective in one rank's backward (a gradient
    hook's all-reduce) would block its peers' behind it. Each rank thread turns that worker off; on
    the CPU the flag is what can be checked (backward runs on the caller there either way)."""
    meshes = simulated_meshes(("dp",), (2,), timeout=10.0)

    def rank(mesh):
        x = torch.ones(3, requires_grad=True)
        seen = []
        x.register_hook(lambda g: seen.append(threading.current_thread().name) or mesh.comm("dp").all_reduce(g))
        (x * 2).sum().backward()
        return torch._C._is_multithreading_enabled(), seen, x.grad.tolist()

    results = run_in_threads(meshes, rank, timeout=30.0)
    assert [r[0] for r in results] == [False, False]
    assert [r[1] for r in results] == [["usc-rank0"], ["usc-rank1"]]
    assert torch._C._is_multithreading_enabled()  # the caller's own setting is untouched
