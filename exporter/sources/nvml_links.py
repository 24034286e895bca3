"""NVLink and PCIe readings of one GPU: per-link state, traffic and error counters, and
the PCIe link's current against its best generation and width.

Byte counters come from the cycle's field values (``nvml_fields``); link states, error
counters and the best PCIe link from the slow tier (``nvml_cadence``), error counters
through its field values where nvml.h has an id; the rest are the per-link and per-GPU
NVML calls that nvidia-smi, nvitop and DCGM use. Everything a driver
or GPU does not support is None, so it becomes no series.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import pynvml

from exporter.model import NvLink, PcieLink
from exporter.sources.nvml_codes import error_name
from exporter.sources.nvml_fields import (
    INVALID_VALUE,
    NOT_ANSWERED,
    NVLINK_BYTES_FIELDS,
    NVLINK_ERROR_FIELDS,
    PCIE_BYTES_FIELDS,
    UNWRITTEN,
    FieldKey,
    answered,
    field_values,
)

Query = Callable[..., Any]  # the source's one-query wrapper: value, or None (error counted)
KIB = 1024  # the NVLink throughput fields count KiB (pynvml.py 13.615.71 lines 689-690)

# nvmlNvLinkErrorCounter_t (pynvml.py lines 112-115), by the `type` label. DCGM reads the
# same four through nvmlDeviceGetNvLinkErrorCounter (DcgmCacheManager.cpp
# ReadAndCacheNvLinkData). Blackwell drivers removed that call (NVML change log, v560 to
# v565: "Removed support for ... nvmlDeviceGetNvLinkErrorCounter() on Blackwell"): there
# it answers NOT_SUPPORTED and these series are absent.
NVLINK_ERRORS: dict[str, int] = {
    "crc_flit": pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
    "crc_data": pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
    "replay": pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
    "recovery": pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
}


def nvlink_count(query: Query, handle: Any, errors: Callable[[str, str], None]) -> int | None:
    """How many NVLinks the GPU has (NVML_FI_DEV_NVLINK_LINK_COUNT, as nvitop's
    ``nvlink_link_count`` reads it): 0 when the field is unsupported (no NVLink), None
    when it could not be read (ask again next cycle), or when it is past
    ``NVML_NVLINK_MAX_LINKS`` (nvml.h; 36 in nvidia-ml-py 13): a count that large would
    size every per-link request and read after it."""
    entries = query(
        "nvlink_count", field_values, handle, ((pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, 0),)
    )
    if entries is None:
        return None
    entry = answered(entries).get((pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, 0))
    if entry is None or entry.nvmlReturn == UNWRITTEN:  # unwritten: not "no NVLink"
        errors("nvlink_count", NOT_ANSWERED)
        return None
    if entry.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED:
        return 0
    if entry.nvmlReturn != pynvml.NVML_SUCCESS:
        errors("nvlink_count", error_name(pynvml.NVMLError(entry.nvmlReturn)))
        return None
    if entry.valueType == UNWRITTEN:
        errors("nvlink_count", NOT_ANSWERED)
        return None
    count = int(entry.value.uiVal)
    if count > pynvml.NVML_NVLINK_MAX_LINKS:  # every per-link read and field is sized by it
        errors("nvlink_count", INVALID_VALUE)
        return None
    return count


# Per link, as the slow tier read it: (link, up or not, error counters by name).
LinkStates = tuple[tuple[int, bool | None, tuple[tuple[str, int], ...]], ...]


def nvlink_states(
    query: Query, handle: Any, count: int, seen_active: set[int]
) -> tuple[bool | None, ...]:
    """Each link's state (nvmlDeviceGetNvLinkState): up, down, or None when unread;
    links found up join ``seen_active``."""
    states = []
    for link in range(count):
        state = query("nvlink_state", pynvml.nvmlDeviceGetNvLinkState, handle, link)
        active = None if state is None else state == pynvml.NVML_FEATURE_ENABLED
        if active:
            seen_active.add(link)
        states.append(active)
    return tuple(states)


def error_links(states: tuple[bool | None, ...], seen_active: set[int]) -> list[int]:
    """The links whose error counters are read: those active or active at some time
    since the exporter started. A link that goes down keeps its counters, so their last
    increase stays visible, while a never-used link costs no reads."""
    return [link for link in range(len(states)) if link in seen_active]


def link_errors(
    query: Query,
    handle: Any,
    states: tuple[bool | None, ...],
    seen_active: set[int],
    fields: Mapping[FieldKey, int | float],
    fallback: Collection[FieldKey],
) -> LinkStates:
    """Each link's state and error counters: from the slow tier's field values for
    links 0-11, through nvmlDeviceGetNvLinkErrorCounter for later links and where the
    driver does not support the field."""
    out = []
    for link, active in enumerate(states):
        counters: list[tuple[str, int]] = []
        if link in seen_active:
            for name, counter in NVLINK_ERRORS.items():
                field_id = NVLINK_ERROR_FIELDS.get((link, name))
                if field_id is not None and (field_id, 0) not in fallback:
                    value = fields.get((field_id, 0))
                else:
                    value = query(
                        "nvlink_errors",
                        pynvml.nvmlDeviceGetNvLinkErrorCounter,
                        handle,
                        link,
                        counter,
                    )
                if value is not None:
                    counters.append((name, int(value)))
        out.append((link, active, tuple(counters)))
    return tuple(out)


def nvlinks(
    count: int, fields: Mapping[FieldKey, int | float], states: LinkStates
) -> tuple[NvLink, ...]:
    """Each link's state and error counters as the slow tier last read them, with this
    cycle's data bytes."""
    tx_field, rx_field = NVLINK_BYTES_FIELDS
    slow = {link: (active, errors) for link, active, errors in states}
    links = []
    for link in range(count):
        active, errors = slow.get(link, (None, ()))
        entry = NvLink(
            link=link,
            active=active,
            transmitted_bytes=_kib(fields.get((tx_field, link))),
            received_bytes=_kib(fields.get((rx_field, link))),
            errors=errors,
        )
        if entry != NvLink(link=link):
            links.append(entry)
    return tuple(links)


def pcie_link(
    query: Query,
    handle: Any,
    fields: Mapping[FieldKey, int | float],
    best: tuple[int | None, int | None],
) -> PcieLink | None:
    """Current and best link generation and width, and cumulative bytes.

    The "max" calls (the slow tier's ``best``) give the best this GPU *in this slot* can
    do ("possible with this device and system": a Gen5 GPU in a Gen4 slot reports 4), so
    current < max means the link trained or fell below what the hardware allows. NVIDIA
    documents that current generation and width "may be reduced when the GPU is not in
    use" (nvidia-smi(1), pcie.link.gen.current): idle power management, not a fault, and
    why the current ones are read every cycle.
    """
    tx_field, rx_field = PCIE_BYTES_FIELDS
    tx, rx = fields.get((tx_field, 0)), fields.get((rx_field, 0))
    link = PcieLink(
        generation=query("pcie_link", pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        max_generation=best[0],
        width=query("pcie_link", pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        max_width=best[1],
        transmitted_bytes=None if tx is None else int(tx),
        received_bytes=None if rx is None else int(rx),
    )
    return None if link == PcieLink() else link


def _kib(value: int | float | None) -> int | None:
    return None if value is None else int(value) * KIB
