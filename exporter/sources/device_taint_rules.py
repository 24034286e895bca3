"""DRA DeviceTaintRules (resource.k8s.io, KEP-5055) that may taint this node's devices.

A DeviceTaintRule "adds one taint to all devices which match the selector. This has the
same effect as if the taint was specified directly in the ResourceSlice by the DRA
driver" (k8s.io/api resource/v1alpha3/types.go at v0.35.0, lines 192-194). So a healthy
device that no claim holds is no capacity while a rule taints it NoSchedule or NoExecute,
exactly as when its driver taints it in the slice (analysis/capacity.py, reason
``device_taint``). Anyone may write such a rule: an admin draining a GPU, a health
monitor, or this exporter for the GPUs it finds unhealthy (reporting/device_taints.py).

This source lists + watches every DeviceTaintRule (the same machinery as the pod watch,
``kube_watch.KubeWatchSource``). The collection is cluster-scoped and a rule names no
node, so no fieldSelector is sent (``node_scoped`` False); kept are the rules whose
``spec.deviceSelector.driver`` is one of ``--dra-drivers`` or is unset (a rule without a
driver may select devices of any driver). What is kept of one is its selector's exact
fields and its effect (``DeviceTaintRuleSelector``); which devices it matches is
capacity's rule (docs/capacity.md, "DeviceTaintRules").

What the API defines (k8s.io/api, resource/v1alpha3/types.go):

- ``spec.deviceSelector`` (``DeviceTaintSelector``): ``driver``, ``pool``, ``device``,
  each optional and exact; "All selector criteria must be satisfied for a device to
  match. The empty selector matches all devices. Without a selector, no devices are
  matched" (v0.35.0 lines 215-218, 229-231). Kubernetes 1.33 and 1.34 also had
  ``deviceClassName`` and CEL ``selectors`` (v0.34.0 lines 226 and 261); 1.35 tombstoned
  both (v0.35.0 lines 238-242, 278-282), so a 1.35 server no longer stores them.
- ``spec.taint``: ``key``, ``value``, ``effect``; "Valid effects are None, NoSchedule and
  NoExecute [...] Consumers must treat unknown effects like None" (v0.35.0 lines
  138-140). 1.33-1.34 knew only NoSchedule and NoExecute (v0.34.0 line 137).
- Versions: ``v1alpha3`` from 1.33 (``introduced=1.33``, v0.35.0 line 190, behind the
  alpha feature gate and ``--runtime-config``), ``v1beta2`` from 1.36
  (v0.36.0 resource/v1beta2/types.go line 850), ``v1`` on the development branch
  (``introduced=1.37`` at k8s.io/api 10b39a39, resource/v1/types.go line 990). The
  version is found once by discovery (``GET /apis/resource.k8s.io`` and each listed
  version's resources, newest first: ``DEVICE_TAINT_VERSIONS``, the writer's order in
  reporting/kube_client.py) and found again when a LIST of it answers 404.

A cluster that serves no DeviceTaintRule (before 1.33, the feature off, or
resource.k8s.io not served at all) has none to apply: the source is up with no rules,
logged once at INFO and asked again every ``NOT_SERVED_RETRY_S``. A refused or failed
read makes it down, and capacity then cannot tell which DRA devices are tainted: their
``disrupted`` and ``allocatable`` are unknown, never "all free".
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from exporter.model import (
    GPU_DRA_DRIVERS,
    DeviceTaintRuleSelector,
    DeviceTaintRuleSnapshot,
    SourceName,
    WatchCounts,
)
from exporter.sources.backoff import Backoff
from exporter.sources.base import Cycle
from exporter.sources.kube_watch import (
    CONNECT_TIMEOUT_S,
    LIST_READ_TIMEOUT_S,
    KubeWatchSource,
    _api_exception,
    _read_bounded,
    describe_error,
    http_status,
)
from exporter.text import one_line

API_GROUP = "resource.k8s.io"
# Newest first, as the writer picks its version (reporting/kube_client.py)
DEVICE_TAINT_VERSIONS = ("v1", "v1beta2", "v1alpha3")
# A cluster without DeviceTaintRules will not grow them until it is upgraded or the
# feature switched on: asked again every few minutes, not every minute.
NOT_SERVED_RETRY_S = 300.0
# Every node's exporter lists the whole cluster's rules: its safety-net relist is hourly,
# not every 5 minutes (a watch that breaks relists at once anyway), so 5,000 nodes make
# about 1.4 full LISTs a second, not 17 (client-go's informers do not relist on resync).
RESYNC_S = 3600.0
# Asked again after "not served" at 300 s +- this share, so nodes started together spread
NOT_SERVED_JITTER = 0.2
# Rules kept (of the watched drivers, or naming none): an admin's handful, and this
# exporter's own, one per unhealthy GPU of the cluster; more makes the source down with
# nothing in it (unknown), never a part.
MAX_RULES = 5000
# One DeviceTaintRule is at most etcd's request limit, 1.5 MiB by default; a LIST of the
# whole cluster's is refused past MAX_LIST_BYTES, one watch line past MAX_RULE_BYTES.
MAX_RULE_BYTES = 4 * 1024 * 1024
MAX_LIST_BYTES = 16 * 1024 * 1024
# A discovery document (an APIGroup, an APIResourceList) is a few KiB.
MAX_DISCOVERY_BYTES = 1024 * 1024
MAX_NAME_CHARS = 253  # a DNS subdomain: driver, pool (its segments) and device names
NOT_SERVED = (
    f"DeviceTaintRules are not served by this API server (no {API_GROUP} version of "
    f"{', '.join(DEVICE_TAINT_VERSIONS)} lists devicetaintrules: Kubernetes before 1.33, "
    "or the feature off)"
)
FORBIDDEN_HINT = (
    f"forbidden: the exporter's ClusterRole needs get, list and watch on devicetaintrules "
    f"in API group {API_GROUP} (Helm value rbac.dra)"
)


class NotServed(Exception):
    """Discovery found no version of resource.k8s.io that serves DeviceTaintRules."""


def _name(value: Any) -> str | None:
    """An exact selector field: a printable string of a name's length; anything else
    (absent, null, another type) None."""
    if isinstance(value, str) and len(value) <= MAX_NAME_CHARS and value.isprintable():
        return value
    return None


def rule_selector(obj: Mapping[str, Any]) -> DeviceTaintRuleSelector | None:
    """A DeviceTaintRule as the API serialises it -> what capacity reads of it; None
    for an object without a name. A selector field of the wrong type or length cannot
    be matched exactly: the rule is then ``opaque`` (which devices it names is unknown),
    as one with ``deviceClassName`` or CEL ``selectors`` is. An effect that is not a
    string is kept as "" (an unknown effect: treated like None, as the API says)."""
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    if not isinstance(name, str) or not name:
        return None
    spec = obj.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    taint = spec.get("taint")
    effect = taint.get("effect") if isinstance(taint, Mapping) else None
    effect = effect if isinstance(effect, str) and len(effect) <= 64 else ""
    selector = spec.get("deviceSelector")
    if selector is None:  # "Without a selector, no devices are matched"
        return DeviceTaintRuleSelector(name, effect, selects=False)
    if not isinstance(selector, Mapping):  # unreadable: any device may be meant
        return DeviceTaintRuleSelector(name, effect, opaque=True)
    exact: dict[str, str | None] = {}
    opaque = False
    for field in ("driver", "pool", "device"):
        raw = selector.get(field)
        exact[field] = _name(raw)
        if raw is not None and exact[field] is None:
            opaque = True  # set, but not to a name we can compare: unknown
    # 1.33-1.34: a DeviceClass's selectors or CEL expressions, not evaluated here
    if set(selector) - {"driver", "pool", "device", "deviceClassName", "selectors"}:
        opaque = True
    if selector.get("deviceClassName") is not None or selector.get("selectors"):
        opaque = True
    return DeviceTaintRuleSelector(
        name,
        effect,
        driver=exact["driver"],
        pool=exact["pool"],
        device=exact["device"],
        opaque=opaque,
    )


class DeviceTaintRuleWatcher(
    KubeWatchSource[DeviceTaintRuleSelector, DeviceTaintRuleSelector, DeviceTaintRuleSnapshot]
):
    """Every DeviceTaintRule whose selector names one of ``drivers`` or no driver;
    ``read()`` hands over the current ``DeviceTaintRuleSnapshot``, rules sorted by name."""

    name: ClassVar[SourceName] = "devicetaintrules"

    # the version is the one discovery found (``_collection_path``)
    path: ClassVar[str] = f"/apis/{API_GROUP}/{{version}}/devicetaintrules"
    resource: ClassVar[str] = "devicetaintrules"
    singular: ClassVar[str] = "DeviceTaintRule"
    thread_name: ClassVar[str] = "devicetaintrule-watcher"
    description: ClassVar[str] = "DRA DeviceTaintRule"
    max_objects: ClassVar[int] = MAX_RULES
    max_list_bytes: ClassVar[int] = MAX_LIST_BYTES
    max_line_bytes: ClassVar[int] = MAX_RULE_BYTES
    node_scoped: ClassVar[bool] = False  # cluster-scoped; a rule names devices, not nodes

    def __init__(
        self,
        node_name: str,
        *,
        kubeconfig: str | None = None,
        drivers: Sequence[str] = GPU_DRA_DRIVERS,
        resync_s: float = RESYNC_S,
        watch_timeout_s: int = 60,
        not_served_retry_s: float = NOT_SERVED_RETRY_S,
    ) -> None:
        if isinstance(drivers, str):
            raise TypeError("drivers must be a sequence of driver names, not a str")
        if not drivers:
            raise ValueError("drivers must name at least one DRA driver")
        if not_served_retry_s <= 0:
            raise ValueError(f"not_served_retry_s must be > 0, got {not_served_retry_s}")
        self._drivers = frozenset(drivers)
        self._not_served_retry_s = not_served_retry_s
        self._version: str | None = None  # the watch thread's: found by discovery
        super().__init__(
            node_name, kubeconfig=kubeconfig, resync_s=resync_s, watch_timeout_s=watch_timeout_s
        )

    @property
    def drivers(self) -> frozenset[str]:
        return self._drivers

    @property
    def version(self) -> str | None:
        """The resource.k8s.io version watched (None: not discovered yet, or none)."""
        return self._version

    def fill(self, cycle: Cycle) -> None:
        cycle.readings.device_taint_rules = self.read(cycle)

    # -- KubeWatchSource hooks --------------------------------------------------------

    def _collection_path(self) -> str:
        return self.path.format(version=self._version or DEVICE_TAINT_VERSIONS[0])

    def _convert(self, obj: Mapping[str, Any]) -> DeviceTaintRuleSelector | None:
        rule = rule_selector(obj)
        if rule is None or (rule.driver is not None and rule.driver not in self._drivers):
            return None  # another driver's devices only
        return rule

    def _items(
        self, values: Iterable[DeviceTaintRuleSelector]
    ) -> tuple[DeviceTaintRuleSelector, ...]:
        return tuple(sorted(values, key=lambda r: r.name))

    def _snapshot(
        self,
        ok: bool,
        timestamp: float,
        error: str | None,
        items: tuple[DeviceTaintRuleSelector, ...],
        counts: WatchCounts,
    ) -> DeviceTaintRuleSnapshot:
        return DeviceTaintRuleSnapshot(
            ok=ok, timestamp=timestamp, error=error, rules=items, counts=counts
        )

    def _list(self, api: Any) -> str:
        """Discover the version first (once, and again after a 404), then LIST it."""
        fresh = self._version is None
        if fresh:
            self._version = self._discover(api)
        try:
            return super()._list(api)
        except Exception as exc:
            if http_status(exc) == 404:
                self._version = None  # the version went away (a downgrade): ask again
                if fresh:
                    raise RuntimeError(
                        "discovery lists devicetaintrules but its LIST answers 404"
                    ) from exc
            raise

    def _explain(self, exc: BaseException) -> str:
        if isinstance(exc, NotServed) or http_status(exc) == 404:
            return NOT_SERVED
        if http_status(exc) == 403:
            return one_line(f"{FORBIDDEN_HINT}; {describe_error(exc)}")
        return describe_error(exc)

    def _not_served(self, exc: BaseException) -> bool:
        # No DeviceTaintRules in this cluster: none taints a device; not an outage.
        return isinstance(exc, NotServed) or http_status(exc) == 404

    def _retry_delay(self, exc: BaseException, backoff: Backoff) -> float:
        delay = backoff.next_delay()
        if not self._not_served(exc):
            return delay
        spread = 1.0 + NOT_SERVED_JITTER * (2.0 * random.random() - 1.0)
        return max(delay, self._not_served_retry_s * spread)

    # -- discovery ----------------------------------------------------------------------

    def _discover(self, api: Any) -> str:
        """The newest resource.k8s.io version whose discovery lists ``devicetaintrules``
        (the writer's rule: reporting/kube_client.py ``device_taint_rule_version``);
        ``NotServed`` when none does. A failed discovery raises its error: unknown is
        not "not served"."""
        group = self._discover_get(api, f"/apis/{API_GROUP}")
        if group is self._GONE:
            raise NotServed(NOT_SERVED)
        listed = group.get("versions") if isinstance(group, Mapping) else None
        if not isinstance(listed, list):
            raise ValueError("discovery answered something that is not an APIGroup")
        served = {v.get("version") for v in listed or () if isinstance(v, Mapping)}
        for version in DEVICE_TAINT_VERSIONS:
            if version not in served:
                continue
            resources = self._discover_get(api, f"/apis/{API_GROUP}/{version}")
            if resources is self._GONE:
                continue
            items = resources.get("resources") if isinstance(resources, Mapping) else None
            if not isinstance(items, list):
                raise ValueError("discovery answered something that is not an APIResourceList")
            if isinstance(items, list) and any(
                isinstance(r, Mapping) and r.get("name") == "devicetaintrules" for r in items
            ):
                return version
        raise NotServed(NOT_SERVED)

    _GONE: ClassVar[object] = object()

    def _discover_get(self, api: Any, path: str) -> Any:
        """GET one discovery document; None when the server answers 404."""
        with self._bounded(self._list_deadline_s, f"discover {path}") as flight:
            method, url, headers, body, post = api.param_serialize(
                "GET",
                path,
                header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"],
            )
            response = api.call_api(
                method,
                url,
                headers,
                body,
                post,
                _request_timeout=(CONNECT_TIMEOUT_S, LIST_READ_TIMEOUT_S),
            ).response
            flight.attach_response(response)
            try:
                if response.status == 404:
                    response.close()
                    return self._GONE
                if not 200 <= response.status <= 299:
                    raise _api_exception(response)
                return json.loads(_read_bounded(response, MAX_DISCOVERY_BYTES))
            except BaseException:
                response.close()
                raise
            finally:
                response.release_conn()
