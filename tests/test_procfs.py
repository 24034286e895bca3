"""procfs source: cgroup parsing, pid reading, and the simulator's proc tree."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest

from exporter.model import ProcessIdentity
from exporter.sim.proctree import (
    CGROUP_VERSIONS,
    DRIVERS,
    QOS_CLASSES,
    RUNTIMES,
    host_cgroup,
    kubepods_cgroup,
    kubepods_path,
    remove_process,
    write_process,
)
from exporter.sources.holders import scan_device_holders
from exporter.sources.procfs import ProcessReader, cgroup_location, parse_cgroup, read_process

# Real-looking identities: RFC 4122 pod UIDs as the API server mints them, a static
# pod UID (the 32-hex manifest hash the kubelet uses), 64-hex container ids.
UID = "d7577106-ebf4-4c63-b5bb-ad0a3444afed"
UID_ = UID.replace("-", "_")  # as the systemd driver spells it
UID2 = "ce6210fc-415c-4a49-999a-7f09c091e354"
UID2_ = UID2.replace("-", "_")
STATIC_UID = "9dd4e461268c8034f5c8564e155c67a6"
CID = "5feceb66ffc86f38d952786c6d696c79c2dbc239dd4e91b46729d73a27fb57e9"
CID2 = "6b86b273ff34fce19d6b804eff5a3f5747ada4eaa22f1d49c01e52ddb7875b4b"
KIND_NODE = "d4735e3a265e16eee03f59718b9b5d03019c07d8b6c51f90da3a666eec13ab35"
OTHER = "4e07408562bedb8b60ce05c1decfe3ad16b72230967de01f640b7e4729b49fce"

SD_BURSTABLE = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
SD_BESTEFFORT = f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice"
SD_GUARANTEED = f"/kubepods.slice/kubepods-pod{UID_}.slice"
# The cgroup a process of (UID, CID) written with the default shape is attributed by.
AT_PATH = kubepods_path(UID, CID)


def v1(path: str, *, unified: str | None = None) -> str:
    """A legacy/hybrid cgroup v1 file: every controller at ``path``."""
    lines = [
        f"12:hugetlb:{path}",
        f"11:memory:{path}",
        f"10:devices:{path}",
        f"9:pids:{path}",
        f"8:perf_event:{path}",
        f"7:cpu,cpuacct:{path}",
        f"6:net_cls,net_prio:{path}",
        f"5:blkio:{path}",
        f"4:freezer:{path}",
        f"3:cpuset:{path}",
        "2:rdma:/",
        f"1:name=systemd:{path}",
    ]
    if unified is not None:
        lines.append(f"0::{unified}")
    return "\n".join(lines) + "\n"


PARSE_CASES = [
    # --- cgroup v2, systemd driver -------------------------------------------------
    pytest.param(
        f"0::{SD_BURSTABLE}/cri-containerd-{CID}.scope\n",
        UID,
        CID,
        id="v2-systemd-containerd-burstable",
    ),
    pytest.param(
        f"0::{SD_BESTEFFORT}/cri-containerd-{CID}.scope\n",
        UID,
        CID,
        id="v2-systemd-containerd-besteffort",
    ),
    pytest.param(
        f"0::{SD_GUARANTEED}/cri-containerd-{CID}.scope\n",
        UID,
        CID,
        id="v2-systemd-containerd-guaranteed",
    ),
    pytest.param(f"0::{SD_BURSTABLE}/crio-{CID}.scope\n", UID, CID, id="v2-systemd-crio-burstable"),
    pytest.param(
        f"0::{SD_GUARANTEED}/crio-{CID}.scope\n", UID, CID, id="v2-systemd-crio-guaranteed"
    ),
    pytest.param(
        f"0::{SD_BURSTABLE}/crio-conmon-{CID}.scope\n",
        UID,
        None,
        id="v2-systemd-crio-conmon-is-not-the-container",
    ),
    pytest.param(
        f"0::{SD_BESTEFFORT}/docker-{CID}.scope\n",
        UID,
        CID,
        id="v2-systemd-docker-cri-dockerd-besteffort",
    ),
    pytest.param(
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{STATIC_UID}.slice"
        f"/cri-containerd-{CID}.scope\n",
        STATIC_UID,
        CID,
        id="v2-systemd-static-pod-32hex-uid",
    ),
    pytest.param(
        f"0::/kubepods.slice/kubepods-pod{STATIC_UID}.slice/crio-{CID}.scope\n",
        STATIC_UID,
        CID,
        id="v2-systemd-static-pod-guaranteed",
    ),
    pytest.param(
        f"0::{SD_BURSTABLE}/cri-containerd-{CID}.scope (deleted)\n",
        UID,
        CID,
        id="v2-deleted-cgroup-suffix-still-attributed",
    ),
    pytest.param(
        f"0::{SD_BURSTABLE}/cri-containerd-{CID}.scope/init\n",
        UID,
        CID,
        id="v2-sub-cgroup-inside-container",
    ),
    pytest.param(
        f"0::{SD_BURSTABLE}/cri-containerd-{CID}.scope/docker/{OTHER}\n",
        UID,
        CID,
        id="v2-docker-in-docker-inside-pod-keeps-outer-container",
    ),
    # --- cgroup v2, cgroupfs driver ------------------------------------------------
    pytest.param(
        f"0::/kubepods/burstable/pod{UID}/{CID}\n", UID, CID, id="v2-cgroupfs-containerd-burstable"
    ),
    pytest.param(
        f"0::/kubepods/besteffort/pod{UID}/{CID}\n",
        UID,
        CID,
        id="v2-cgroupfs-containerd-besteffort",
    ),
    pytest.param(
        f"0::/kubepods/pod{UID}/{CID}\n", UID, CID, id="v2-cgroupfs-containerd-guaranteed"
    ),
    pytest.param(f"0::/kubepods/burstable/pod{UID}/crio-{CID}\n", UID, CID, id="v2-cgroupfs-crio"),
    pytest.param(
        f"0::/kubepods/burstable/pod{UID}/crio-conmon-{CID}\n",
        UID,
        None,
        id="v2-cgroupfs-crio-conmon",
    ),
    pytest.param(
        f"0::/kubepods/besteffort/pod{STATIC_UID}/{CID}\n",
        STATIC_UID,
        CID,
        id="v2-cgroupfs-static-pod",
    ),
    # --- cgroup v1 (legacy and hybrid) ---------------------------------------------
    pytest.param(
        v1(f"{SD_BURSTABLE}/docker-{CID}.scope"), UID, CID, id="v1-systemd-docker-centos7"
    ),
    pytest.param(
        v1(f"{SD_GUARANTEED}/cri-containerd-{CID}.scope"),
        UID,
        CID,
        id="v1-systemd-containerd-guaranteed",
    ),
    pytest.param(
        v1(f"/kubepods/burstable/pod{UID}/{CID}"), UID, CID, id="v1-cgroupfs-dockershim-burstable"
    ),
    pytest.param(v1(f"/kubepods/pod{UID}/{CID}"), UID, CID, id="v1-cgroupfs-guaranteed"),
    pytest.param(
        v1(f"/kubepods/besteffort/pod{UID}/crio-{CID}"), UID, CID, id="v1-cgroupfs-crio-besteffort"
    ),
    pytest.param(
        v1(f"/kubepods/burstable/pod{UID}/{CID}", unified="/"),
        UID,
        CID,
        id="v1-hybrid-empty-unified-line-falls-back-to-v1",
    ),
    pytest.param(
        v1(f"/kubepods/burstable/pod{UID}/{CID}", unified="/system.slice/containerd.service"),
        UID,
        CID,
        id="v1-hybrid-unified-line-on-runtime-unit-falls-back-to-v1",
    ),
    pytest.param(
        v1(
            f"/kubepods/burstable/pod{UID2}/{CID2}",
            unified=f"{SD_BURSTABLE}/cri-containerd-{CID}.scope",
        ),
        UID,
        CID,
        id="v1-hybrid-disagreeing-lines-prefer-v2",
    ),
    pytest.param(
        f"11:memory:/kubepods/burstable/pod{UID}\n4:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}\n",
        UID,
        CID,
        id="v1-line-with-container-preferred-over-pod-only-line",
    ),
    pytest.param(
        f"5:memory:/kubepods/burstable/pod{UID}/{CID}\n4:pids:/kubepods/burstable/pod{UID2}/{CID2}\n",
        UID,
        CID,
        id="v1-disagreeing-lines-first-wins",
    ),
    # --- nested runtimes -----------------------------------------------------------
    pytest.param(
        v1(f"/docker/{KIND_NODE}/kubepods/burstable/pod{UID}/{CID}"),
        UID,
        CID,
        id="kind-v1-cgroupfs-under-docker-node",
    ),
    pytest.param(
        "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice"
        f"/kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
        UID,
        CID,
        id="kind-v2-kubelet-slice-node-view",
    ),
    pytest.param(
        f"0::/system.slice/docker-{KIND_NODE}.scope/kubelet.slice/kubelet-kubepods.slice"
        f"/kubelet-kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
        UID,
        CID,
        id="kind-v2-host-view-ignores-node-container-id",
    ),
    # --- private cgroup namespaces (reader inside a container) ---------------------
    pytest.param(
        f"0::/../cri-containerd-{CID}.scope\n", None, CID, id="cgroupns-sibling-container-no-pod"
    ),
    pytest.param(f"0::/../crio-{CID}.scope\n", None, CID, id="cgroupns-sibling-crio-container"),
    pytest.param(
        f"0::/../../../kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
        f"/cri-containerd-{CID}.scope\n",
        UID,
        CID,
        id="cgroupns-other-pod-visible-above-root",
    ),
    pytest.param(f"0::/../burstable/pod{UID}/{CID}\n", UID, CID, id="cgroupns-cgroupfs-other-pod"),
    pytest.param("0::/\n", None, None, id="cgroupns-own-container-root"),
    pytest.param(f"0::/../crio-conmon-{CID}.scope\n", None, None, id="cgroupns-sibling-conmon"),
    # --- containerd's slice:prefix:id notation --------------------------------------
    pytest.param(
        f"0::/kubepods-besteffort-pod{UID_}.slice:cri-containerd:{CID}\n",
        UID,
        CID,
        id="containerd-slice-notation",
    ),
    pytest.param(
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice:crio:{CID}\n",
        UID,
        CID,
        id="slice-notation-crio-under-full-path",
    ),
    # --- pod-level and QoS-level cgroups, host processes ---------------------------
    pytest.param(f"0::{SD_BURSTABLE}\n", UID, None, id="pod-level-cgroup-has-pod-no-container"),
    pytest.param(f"0::/kubepods/pod{UID}\n", UID, None, id="pod-level-cgroupfs"),
    pytest.param(
        "0::/kubepods.slice/kubepods-burstable.slice\n", None, None, id="qos-level-cgroup"
    ),
    pytest.param("0::/kubepods.slice\n", None, None, id="kubepods-root"),
    pytest.param("0::/system.slice/sshd.service\n", None, None, id="host-sshd"),
    pytest.param("0::/system.slice/kubelet.service\n", None, None, id="host-kubelet"),
    pytest.param("0::/system.slice/containerd.service\n", None, None, id="host-containerd"),
    pytest.param(
        "0::/user.slice/user-1000.slice/session-3.scope\n", None, None, id="host-user-session"
    ),
    pytest.param("0::/init.scope\n", None, None, id="host-init"),
    pytest.param("0::/\n", None, None, id="host-root"),
    pytest.param(v1("/system.slice/sshd.service"), None, None, id="host-v1"),
    pytest.param(
        f"0::/system.slice/docker-{OTHER}.scope\n",
        None,
        None,
        id="plain-docker-container-is-not-a-pod",
    ),
    # --- garbage: never crash, never a wrong pod -----------------------------------
    pytest.param("", None, None, id="garbage-empty"),
    pytest.param("\n\n  \n", None, None, id="garbage-blank-lines"),
    pytest.param("\x00\x01\x02\ufffd\ufffd\x7f:\x00:\n", None, None, id="garbage-binary"),
    pytest.param(
        f"{SD_BURSTABLE}/cri-containerd-{CID}.scope\n", None, None, id="garbage-no-colons"
    ),
    pytest.param(
        f"x::{SD_BURSTABLE}/cri-containerd-{CID}.scope\n", None, None, id="garbage-hierarchy-id"
    ),
    pytest.param(
        f"0::kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
        None,
        None,
        id="garbage-relative-path",
    ),
    pytest.param(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burst",
        None,
        None,
        id="garbage-truncated-line",
    ),
    pytest.param(
        f"0::/kubepods.slice/kubepods-pod{UID_[:-1]}.slice/cri-containerd-{CID}.scope\n",
        None,
        None,
        id="garbage-truncated-uid",
    ),
    pytest.param(
        f"0::/kubepods.slice/kubepods-pod{UID_[:-1]}g.slice/cri-containerd-{CID}.scope\n",
        None,
        None,
        id="garbage-non-hex-uid",
    ),
    pytest.param(
        f"0::/kubepods.slice/kubepods-pod{UID}.slice/cri-containerd-{CID}.scope\n",
        None,
        None,
        id="garbage-dashed-uid-in-systemd-slice",
    ),
    pytest.param(
        f"0::/kubepods.slice/kubepods-pod{UID_[:13]}-{UID_[14:]}.slice/cri-containerd-{CID}.scope\n",
        None,
        None,
        id="garbage-mixed-separator-uid",
    ),
    pytest.param(
        f"0::/kubepods.slice/kubepods-burstable-pod{UID_}.scope/cri-containerd-{CID}.scope\n",
        None,
        None,
        id="garbage-pod-scope-not-slice",
    ),
    pytest.param(
        f"0::/kubepods.slice/kubepods-guaranteed-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
        None,
        None,
        id="garbage-unknown-qos-class",
    ),
    pytest.param(
        f"0::{SD_BURSTABLE}/cri-containerd-{CID[:63]}.scope\n", UID, None, id="garbage-63-hex-id"
    ),
    pytest.param(
        f"0::{SD_BURSTABLE}/cri-containerd-{CID}a.scope\n", UID, None, id="garbage-65-hex-id"
    ),
    pytest.param(
        f"0::{SD_BURSTABLE}/cri-containerd-{CID[:63]}z.scope\n", UID, None, id="garbage-non-hex-id"
    ),
    pytest.param(
        f"0::{SD_BURSTABLE}/runc-{CID}.scope\n", UID, None, id="garbage-unknown-runtime-prefix"
    ),
    pytest.param(
        f"0::/kubepods/burstable/pod{UID}/{CID[:40]}\n", UID, None, id="garbage-truncated-bare-id"
    ),
    pytest.param(
        f"0::/system.slice/pod{UID}/{CID}\n", None, None, id="garbage-pod-dir-outside-kubepods"
    ),
    pytest.param(
        f"0::/kubepods/burstable/pod{UID[:-2]}/{CID}\n", None, None, id="garbage-short-cgroupfs-uid"
    ),
    pytest.param(f"0::/../{CID}\n", None, None, id="garbage-bare-id-without-pod"),
    pytest.param(
        f"\x00garbage\n7:memory\n0::{SD_BURSTABLE}/cri-containerd-{CID}.scope\n",
        UID,
        CID,
        id="garbage-lines-before-a-good-line-are-skipped",
    ),
    pytest.param(
        f"0::/KUBEPODS.SLICE/KUBEPODS-POD{UID_.upper()}.SLICE/CRI-CONTAINERD-{CID.upper()}.SCOPE\n",
        None,
        None,
        id="garbage-upper-case-path-components",
    ),
    pytest.param(
        f"0::/kubepods/burstable/pod{UID.upper()}/{CID.upper()}\n",
        UID,
        CID,
        id="upper-case-hex-is-normalised",
    ),
]


@pytest.mark.parametrize(("text", "pod_uid", "container_id"), PARSE_CASES)
def test_parse_cgroup_attributes_real_world_paths(
    text: str, pod_uid: str | None, container_id: str | None
) -> None:
    assert parse_cgroup(text) == (pod_uid, container_id)


def test_table_identities_are_well_formed() -> None:
    # A typo in a constant would silently turn a positive case into a garbage case.
    for cid in (CID, CID2, KIND_NODE, OTHER):
        assert len(cid) == 64
        int(cid, 16)
    assert len(STATIC_UID) == 32
    assert len(UID) == len(UID2) == 36


# ---------------------------------------------------------------------------
# Simulator cgroup writer round-trips through the parser
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("qos", "runtime", "driver", "version", "uid"),
    list(itertools.product(QOS_CLASSES, RUNTIMES, DRIVERS, CGROUP_VERSIONS, (UID, STATIC_UID))),
)
def test_kubepods_cgroup_round_trips_through_parser(
    qos: str, runtime: str, driver: str, version: int, uid: str
) -> None:
    text = kubepods_cgroup(uid, CID, qos=qos, runtime=runtime, driver=driver, version=version)
    assert parse_cgroup(text) == (uid, CID)
    lines = text.splitlines()
    if version == 2:
        assert lines == [lines[0]] and lines[0].startswith("0::/")
    else:
        assert len(lines) > 1 and not any(line.startswith("0::") for line in lines)


def test_kubepods_cgroup_writes_the_kubelet_spelling() -> None:
    assert kubepods_cgroup(UID, CID) == f"0::{SD_BURSTABLE}/cri-containerd-{CID}.scope\n"
    assert (
        kubepods_cgroup(UID, CID, qos="guaranteed", runtime="crio")
        == f"0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope\n"
    )
    assert (
        kubepods_cgroup(UID, CID, qos="besteffort", runtime="crio", driver="cgroupfs")
        == f"0::/kubepods/besteffort/pod{UID}/crio-{CID}\n"
    )
    v1_text = kubepods_cgroup(UID, CID, runtime="docker", driver="cgroupfs", version=1)
    assert f"10:memory:/kubepods/burstable/pod{UID}/{CID}\n" in v1_text
    assert f"1:name=systemd:/kubepods/burstable/pod{UID}/{CID}\n" in v1_text


@pytest.mark.parametrize(
    "kwargs",
    [
        {"pod_uid": UID_, "container_id": CID},
        {"pod_uid": UID, "container_id": CID[:63]},
        {"pod_uid": UID, "container_id": CID, "qos": "Guaranteed"},
        {"pod_uid": UID, "container_id": CID, "runtime": "runc"},
        {"pod_uid": UID, "container_id": CID, "driver": "systemdx"},
        {"pod_uid": UID, "container_id": CID, "version": 3},
    ],
    ids=["underscored-uid", "short-id", "qos-case", "runtime", "driver", "version"],
)
def test_kubepods_cgroup_rejects_invalid_input(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        kubepods_cgroup(**kwargs)  # type: ignore[arg-type]


def test_host_cgroup_is_not_attributed() -> None:
    assert host_cgroup() == "0::/system.slice/sshd.service\n"
    assert parse_cgroup(host_cgroup("kubelet.service")) == (None, None)


# ---------------------------------------------------------------------------
# read_process / ProcessReader.identify
# ---------------------------------------------------------------------------

# A verbatim stat line (52 fields) as the kernel writes it, comm with ")" and spaces.
RAW_STAT = (
    "4242 (x) (y) z) D 1 4242 4242 0 -1 4194560 31402 0 12 0 5321 804 0 0 20 0 12 0 "
    "1843265 35817193472 412031 18446744073709551615 94528389586944 94528389611493 "
    "140728423517056 0 0 0 0 16781312 134234626 1 0 0 17 3 0 0 0 0 0 94528389624816 "
    "94528389626184 94528414502912 140728423523663 140728423523694 140728423523694 "
    "140728423526382 0\n"
)


def test_read_process_alive_in_pod(tmp_path: Path) -> None:
    write_process(tmp_path, 4242, comm="python3", state="R", cgroup=kubepods_cgroup(UID, CID))
    assert read_process(tmp_path, 4242) == ProcessIdentity(
        pid=4242,
        alive=True,
        pod_uid=UID,
        container_id=CID,
        comm="python3",
        state="R",
        cgroup_path=AT_PATH,
        cgroup_version=2,
    )


def test_read_process_host_process_is_alive_without_pod(tmp_path: Path) -> None:
    write_process(tmp_path, 811, comm="sshd", cgroup=host_cgroup())
    assert read_process(tmp_path, 811) == ProcessIdentity(
        pid=811, alive=True, comm="sshd", state="S"
    )


def test_read_process_missing_dir_is_dead(tmp_path: Path) -> None:
    assert read_process(tmp_path, 999_999) == ProcessIdentity(pid=999_999, alive=False)
    assert read_process(tmp_path / "no-such-root", 1) == ProcessIdentity(pid=1, alive=False)


def test_read_process_removed_process_is_dead(tmp_path: Path) -> None:
    write_process(tmp_path, 77, comm="worker", cgroup=kubepods_cgroup(UID, CID))
    remove_process(tmp_path, 77)
    remove_process(tmp_path, 77)  # idempotent
    assert read_process(tmp_path, 77) == ProcessIdentity(pid=77, alive=False)
    assert [p.name for p in tmp_path.iterdir()] == []  # no staging leftovers


def test_read_process_parses_comm_by_last_paren(tmp_path: Path) -> None:
    pid_dir = tmp_path / "4242"
    pid_dir.mkdir()
    (pid_dir / "cgroup").write_text(kubepods_cgroup(UID, CID))
    (pid_dir / "stat").write_text(RAW_STAT)
    identity = read_process(tmp_path, 4242)
    assert (identity.comm, identity.state) == ("x) (y) z", "D")


@pytest.mark.parametrize("comm", ["my app (v2)", "a) S (b", ")", "(", "py thon"])
def test_write_process_comm_with_parens_and_spaces_round_trips(tmp_path: Path, comm: str) -> None:
    write_process(tmp_path, 10, comm=comm, state="S", cgroup=host_cgroup())
    identity = read_process(tmp_path, 10)
    assert (identity.comm, identity.state) == (comm, "S")
    assert (tmp_path / "10" / "comm").read_text() == f"{comm}\n"


def test_write_process_truncates_comm_like_the_kernel(tmp_path: Path) -> None:
    write_process(tmp_path, 10, comm="python3 -m torch.distributed.run", cgroup=host_cgroup())
    assert read_process(tmp_path, 10).comm == "python3 -m torc"


def test_write_process_stat_has_all_52_fields(tmp_path: Path) -> None:
    write_process(tmp_path, 10, comm="a b", cgroup=host_cgroup())
    stat = (tmp_path / "10" / "stat").read_text()
    assert stat.endswith("\n")
    assert len(stat[stat.rfind(")") + 1 :].split()) == 52 - 2


@pytest.mark.parametrize("state", ["D", "Z", "R", "S", "I", "T"])
def test_read_process_reports_state_letter(tmp_path: Path, state: str) -> None:
    write_process(tmp_path, 31337, comm="trainer", state=state, cgroup=kubepods_cgroup(UID, CID))
    identity = read_process(tmp_path, 31337)
    assert identity.alive is True
    assert identity.state == state
    assert (identity.pod_uid, identity.container_id) == (UID, CID)


def test_write_process_updates_existing_process(tmp_path: Path) -> None:
    write_process(tmp_path, 5, comm="trainer", state="R", cgroup=kubepods_cgroup(UID, CID))
    write_process(tmp_path, 5, comm="trainer", state="Z", cgroup=kubepods_cgroup(UID2, CID2))
    assert read_process(tmp_path, 5) == ProcessIdentity(
        pid=5,
        alive=True,
        pod_uid=UID2,
        container_id=CID2,
        comm="trainer",
        state="Z",
        cgroup_path=kubepods_path(UID2, CID2),
        cgroup_version=2,
    )
    assert sorted(p.name for p in (tmp_path / "5").iterdir()) == ["cgroup", "comm", "stat"]


def test_write_process_rejects_bad_state(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        write_process(tmp_path, 5, comm="x", state="Q", cgroup=host_cgroup())


def test_read_process_unreadable_cgroup_keeps_process_alive(tmp_path: Path) -> None:
    # A directory where the file should be fails to read regardless of privileges
    # (tests may run as root, where chmod 000 would not stop the read).
    write_process(tmp_path, 12, comm="nvidia-smi", state="S", cgroup=host_cgroup())
    (tmp_path / "12" / "cgroup").unlink()
    (tmp_path / "12" / "cgroup").mkdir()
    assert read_process(tmp_path, 12) == ProcessIdentity(
        pid=12, alive=True, comm="nvidia-smi", state="S", cgroup_read=False
    )
    reader = ProcessReader(tmp_path)  # counted as an error on every read
    reader.identify([12])
    reader.identify([12])
    assert reader.errors_total == 2


def test_read_process_unreadable_stat_keeps_attribution(tmp_path: Path) -> None:
    write_process(tmp_path, 12, comm="x", cgroup=kubepods_cgroup(UID, CID))
    (tmp_path / "12" / "stat").unlink()
    (tmp_path / "12" / "stat").mkdir()
    assert read_process(tmp_path, 12) == ProcessIdentity(
        pid=12, alive=True, pod_uid=UID, container_id=CID, cgroup_path=AT_PATH, cgroup_version=2
    )


def test_read_process_fifo_for_a_file_fails_the_read_without_waiting(tmp_path: Path) -> None:
    # A FIFO where /proc/<pid>/cgroup should be: opening it for reading would block
    # until a writer came, and the sample cycle with it. Read without waiting, it holds
    # nothing a cgroup file holds: the owner is unknown, never a host process.
    write_process(tmp_path, 12, comm="x", state="S", cgroup=host_cgroup())
    (tmp_path / "12" / "cgroup").unlink()
    os.mkfifo(tmp_path / "12" / "cgroup")
    assert read_process(tmp_path, 12) == ProcessIdentity(
        pid=12, alive=True, comm="x", state="S", cgroup_parsed=False
    )


def test_read_process_reads_whole_files_and_bounds_huge_ones(tmp_path: Path) -> None:
    # A cgroup file of several pages is read to its end (the last line names the pod).
    # One beyond the read limit is not read whole, and what was read is no evidence:
    # well-formed host lines up to the limit must not make the process a host one.
    write_process(tmp_path, 12, comm="x", cgroup=kubepods_cgroup(UID, CID))
    cgroup = tmp_path / "12" / "cgroup"
    real = cgroup.read_text()
    cgroup.write_text("".join(f"{n}:name=pad{n}:/\n" for n in range(1, 800)) + real)
    assert 12 * 1024 < cgroup.stat().st_size < 64 * 1024
    assert read_process(tmp_path, 12).pod_uid == UID
    cgroup.write_text("".join(f"{n}:name=pad{n}:/\n" for n in range(1, 4000)) + real)
    assert cgroup.stat().st_size > 64 * 1024
    assert read_process(tmp_path, 12) == ProcessIdentity(
        pid=12, alive=True, comm="x", state="S", cgroup_read=False
    )


def test_read_process_garbage_stat_gives_unknown_comm_and_state(tmp_path: Path) -> None:
    pid_dir = tmp_path / "9"
    pid_dir.mkdir()
    (pid_dir / "cgroup").write_bytes(b"\xff\xfe\x00garbage")
    (pid_dir / "stat").write_bytes(b"9 no-parens R 1 2 3")
    # a cgroup of junk is no evidence of a host process either: owner unknown
    assert read_process(tmp_path, 9) == ProcessIdentity(pid=9, alive=True, cgroup_parsed=False)


def test_read_process_file_vanishing_mid_read_means_dead(tmp_path: Path) -> None:
    # The process exited between the cgroup and the stat read. In a real /proc a pid
    # directory always has both files, so a missing one means the pid is gone (and a
    # directory seen again may already be a reused pid): dead, and no exception.
    pid_dir = tmp_path / "300"
    pid_dir.mkdir()
    (pid_dir / "cgroup").write_text(kubepods_cgroup(UID, CID))
    assert read_process(tmp_path, 300) == ProcessIdentity(pid=300, alive=False)
    (pid_dir / "cgroup").unlink()
    (pid_dir / "stat").write_text(RAW_STAT)
    assert read_process(tmp_path, 300) == ProcessIdentity(pid=300, alive=False)


def test_process_reader_identify_sorted_deduplicated_mixed(tmp_path: Path) -> None:
    write_process(tmp_path, 30, comm="a", cgroup=kubepods_cgroup(UID, CID))
    write_process(tmp_path, 10, comm="b", cgroup=host_cgroup())
    result = ProcessReader(tmp_path).identify([30, 20, 10, 30, 10])
    assert [p.pid for p in result] == [10, 20, 30]
    assert [p.alive for p in result] == [True, False, True]
    assert result[2].pod_uid == UID
    assert ProcessReader(tmp_path).identify([]) == ()


def test_reading_pids_interns_none_of_their_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.11's pathlib interns every path component it parses: a Path per pid put
    each new pid's name in the interpreter's interned-string table, which under process
    churn grew once by ~1.9 MiB that the import floor never pays (benchmarks/README.md,
    "RSS beside the import floor"). The pid readers build their per-pid paths as strings."""
    pids = range(70001, 70041)
    for pid in pids:
        write_process(tmp_path, pid, comm="w", cgroup=kubepods_cgroup(UID, CID))
        (tmp_path / str(pid) / "fd").mkdir()
    interned: list[str] = []
    real_intern = sys.intern

    def recording(text: str) -> str:
        interned.append(text)
        return real_intern(text)

    monkeypatch.setattr(sys, "intern", recording)  # the standard library's, not ours
    reader = ProcessReader(tmp_path)
    assert all(p.alive and p.pod_uid == UID for p in reader.identify(pids))
    assert all(p.alive for p in reader.identify(pids))  # the cached path, stat only
    assert read_process(tmp_path, 70001).alive
    scan_device_holders(tmp_path, [0], exclude_pids=())
    names = {str(pid) for pid in pids}
    assert not names & set(interned), sorted(names & set(interned))[:5]


def test_read_process_on_real_proc_self() -> None:
    # The real kernel format, whatever cgroup setup this machine has.
    identity = read_process(Path("/proc"), os.getpid())
    assert identity.alive is True
    assert identity.state in {"R", "S"}
    assert identity.comm
    assert read_process(Path("/proc"), 2**22 + 12345).alive is False


def test_process_reader_reads_a_known_pids_cgroup_only_once(tmp_path: Path) -> None:
    reader = ProcessReader(tmp_path)
    write_process(tmp_path, 40, comm="trainer", state="R", cgroup=kubepods_cgroup(UID, CID))
    first = reader.identify([40])
    # the cgroup file may now be anything: a live pid keeps its cgroup, so it is not re-read
    (tmp_path / "40" / "cgroup").write_text(host_cgroup())
    write_process(tmp_path, 40, comm="trainer", state="D", cgroup=host_cgroup())
    (tmp_path / "40" / "cgroup").write_text("garbage that would not parse")
    second = reader.identify([40])
    assert first == (
        ProcessIdentity(40, True, UID, CID, "trainer", "R", cgroup_path=AT_PATH, cgroup_version=2),
    )
    # state is fresh; the cgroup path is the one read first
    assert second == (
        ProcessIdentity(40, True, UID, CID, "trainer", "D", cgroup_path=AT_PATH, cgroup_version=2),
    )


def test_process_reader_rereads_the_cgroup_when_a_pid_is_reused(tmp_path: Path) -> None:
    reader = ProcessReader(tmp_path)
    write_process(tmp_path, 41, comm="old", cgroup=kubepods_cgroup(UID, CID))
    reader.identify([41])
    remove_process(tmp_path, 41)
    assert reader.identify([41]) == (ProcessIdentity(pid=41, alive=False),)
    # a new process with the same pid, a later start time and another cgroup
    write_process(tmp_path, 41, comm="new", cgroup=host_cgroup())
    stat = (tmp_path / "41" / "stat").read_text().split(" ")
    stat[21] = str(int(stat[21]) + 1000)
    (tmp_path / "41" / "stat").write_text(" ".join(stat))
    assert reader.identify([41]) == (ProcessIdentity(41, True, None, None, "new", "S"),)


def test_process_reader_agrees_with_read_process(tmp_path: Path) -> None:
    write_process(tmp_path, 50, comm="a", state="R", cgroup=kubepods_cgroup(UID, CID))
    write_process(tmp_path, 51, comm="b", state="Z", cgroup=host_cgroup())
    reader = ProcessReader(tmp_path)
    uncached = tuple(read_process(tmp_path, pid) for pid in (50, 51, 52))
    for _ in range(2):  # uncached, then cached
        assert reader.identify([51, 50, 52, 50]) == uncached


# /proc failing wholesale
# ---------------------------------------------------------------------------


def unreadable(pid_dir: Path) -> None:
    """Both files a directory: EISDIR on every read, for root too."""
    for name in ("stat", "cgroup"):
        (pid_dir / name).unlink()
        (pid_dir / name).mkdir()


def test_most_pids_unreadable_is_the_source_down_with_no_identities(tmp_path: Path) -> None:
    reader = ProcessReader(tmp_path)
    for pid in (60, 61, 62):
        write_process(tmp_path, pid, comm="w", cgroup=kubepods_cgroup(UID, CID))
    assert len(reader.identify([60, 61, 62])) == 3 and reader.status().up
    for pid in (60, 61):
        unreadable(tmp_path / str(pid))
    remove_process(tmp_path, 62)  # gone: a read that proves nothing while /proc fails
    assert reader.identify([60, 61, 62]) == ()  # every owner unknown, none dead
    status = reader.status()
    assert not status.up
    assert status.error == ("EISDIR: 4 of 5 reads failed, 2 of 2 pids unreadable (Is a directory)")


def test_a_minority_of_unreadable_pids_leaves_the_source_up(tmp_path: Path) -> None:
    reader = ProcessReader(tmp_path)
    for pid in (70, 71, 72):
        write_process(tmp_path, pid, comm="w", cgroup=kubepods_cgroup(UID, CID))
    unreadable(tmp_path / "70")
    identities = reader.identify([70, 71, 72])
    assert [(p.pid, p.alive, p.cgroup_read) for p in identities] == [
        (70, True, False),
        (71, True, True),
        (72, True, True),
    ]
    assert reader.status().up and reader.status().error is None


def test_the_source_is_up_again_once_proc_reads(tmp_path: Path) -> None:
    reader = ProcessReader(tmp_path)
    write_process(tmp_path, 80, comm="w", cgroup=kubepods_cgroup(UID, CID))
    unreadable(tmp_path / "80")
    assert reader.identify([80]) == () and not reader.status().up
    for name in ("stat", "cgroup"):
        (tmp_path / "80" / name).rmdir()
    write_process(tmp_path, 80, comm="w", cgroup=kubepods_cgroup(UID, CID))
    assert reader.identify([80])[0].pod_uid == UID
    assert reader.status().up


# -- the cgroup that attributed the process (for the cgroup source) ---------------------


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("qos", QOS_CLASSES)
def test_cgroup_location_is_the_v2_path(driver: str, qos: str) -> None:
    text = kubepods_cgroup(UID, CID, qos=qos, driver=driver, version=2)
    assert cgroup_location(text) == (kubepods_path(UID, CID, qos=qos, driver=driver), 2)


def test_cgroup_location_on_v1_is_the_cpu_controllers_line() -> None:
    text = kubepods_cgroup(UID, CID, version=1)
    assert cgroup_location(text) == (kubepods_path(UID, CID), 1)
    # a hybrid host: the unified line names no pod, the v1 cpu line does
    hybrid = "0::/\n12:memory:/x\n4:cpu,cpuacct:" + kubepods_path(UID, CID) + "\n"
    assert cgroup_location(hybrid) == (kubepods_path(UID, CID), 1)


def test_cgroup_location_none_for_host_garbage_and_no_cpu_line() -> None:
    assert cgroup_location(host_cgroup()) is None
    assert cgroup_location("garbage") is None
    assert cgroup_location("") is None
    # v1 without the cpu controller naming the pod: no directory holds its cpu.stat
    assert cgroup_location("7:memory:" + kubepods_path(UID, CID) + "\n") is None


def test_cgroup_location_drops_the_deleted_suffix() -> None:
    path = kubepods_path(UID, CID)
    assert cgroup_location(f"0::{path} (deleted)\n") == (path, 2)


def test_a_host_process_has_no_cgroup_path(tmp_path: Path) -> None:
    write_process(tmp_path, 811, comm="sshd", cgroup=host_cgroup())
    identity = read_process(tmp_path, 811)
    assert (identity.cgroup_path, identity.cgroup_version) == (None, None)
