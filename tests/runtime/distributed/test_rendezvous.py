"""The rendezvous a launcher writes into the environment (torchrun, srun), and one clear line when it is wrong."""

from __future__ import annotations

import socket

import pytest

from octavo.cli import main
from octavo.errors import OctavoError
from octavo.runtime.distributed.rendezvous import first_host, launched_rendezvous, tasks_per_node_list

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "2",
            "TORCHELASTIC_USE_AGENT_STORE": "True"}
SRUN = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_STEP_NODELIST": "gpu[07-09]", "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "0"}


def test_no_launcher_means_no_rendezvous():
    assert launched_rendezvous({"PATH": "/bin", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) is None


def test_torchrun_variables_give_the_rank_its_node_share_and_the_agent_store():
    rendezvous = launched_rendezvous(TORCHRUN)
    assert (rendezvous.rank, rendezvous.world_size, rendezvous.local_rank, rendezvous.local_world_size) == (3, 4, 1, 2)
    assert (rendezvous.endpoint, rendezvous.launcher, rendezvous.agent_store) == ("node0:29500", "torchrun", True)
    assert rendezvous.store_prefix == "octavo/job7-2/"  # apart from the keys of the launch before the restart


def test_srun_variables_give_the_first_node_as_the_address_and_a_port_from_the_job_id():
    rendezvous = launched_rendezvous(SRUN)
    assert (rendezvous.rank, rendezvous.world_size, rendezvous.local_rank, rendezvous.local_world_size) == (5, 6, 1, 2)
    assert (rendezvous.endpoint, rendezvous.launcher) == ("gpu07:32956", "srun")  # 29500 + 123456 % 10000
    with_master = launched_rendezvous({**SRUN, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert with_master.endpoint == "head:1234"
    assert launched_rendezvous({**SRUN, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h",
                                "MASTER_PORT": "1"}).launcher == "env"  # torchrun inside srun: torchrun's ranks


@pytest.mark.parametrize(("nodelist", "first"), [("gpu[07-09,12],cpu1", "gpu07"), ("node1,node2", "node1"),
                                                 ("a[3]b", "a3b"), ("single", "single")])
def test_the_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_host(nodelist) == first


def test_slurm_tasks_per_node_expand():
    assert tasks_per_node_list("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(OctavoError, match="cannot read the tasks per node"):
        tasks_per_node_list("two")


@pytest.mark.parametrize(("environ", "message"), [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR, MASTER_PORT are not set"),
    ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "port 70000 is not a TCP port"),
    ({**TORCHRUN, "RANK": "4"}, "rank 4 is outside a world of 4 ranks"),
])
def test_partial_or_malformed_variables_are_named(environ, message):
    with pytest.raises(OctavoError, match=message):
        launched_rendezvous(environ)


@pytest.fixture
def artifact(tiny_artifact, capfd) -> str:
    """The tiny llama artifact, built before the test reads what it printed."""
    path = str(tiny_artifact("llama"))
    capfd.readouterr()
    return path


def _one_error_line(capfd) -> str:
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: "), lines
    return lines[0]


def test_a_rank_without_the_rendezvous_address_fails_in_one_line(artifact, monkeypatch, capfd):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["generate", artifact, "--prompt", "x", "-tp", "2"]) == 1
    assert "RANK=1, WORLD_SIZE=2" in _one_error_line(capfd)


def test_a_rank_whose_rendezvous_nobody_hosts_fails_in_one_line(artifact, monkeypatch, capfd):
    with socket.socket() as probe:  # a port that was free a moment ago: nobody listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    assert main(["generate", artifact, "--prompt", "x", "-tp", "2", "--threads", "1",
                 "--rendezvous-timeout", "1"]) == 1
    line = _one_error_line(capfd)
    assert f"rank 1 could not reach the rendezvous at 127.0.0.1:{port} within 1s" in line, line


def test_a_launch_of_another_size_is_named(artifact, monkeypatch, capfd):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "3"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    assert main(["generate", artifact, "--prompt", "x", "-tp", "2"]) == 1
    assert "started 3 ranks (WORLD_SIZE), but --tensor-parallel-size 2" in _one_error_line(capfd)
