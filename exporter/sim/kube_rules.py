"""What the real kube-apiserver refuses, and how it applies a patch, for the objects
the API stand-in's write side serves (kube_writes.py): pure functions, no I/O.

The rules and messages are the real server's (Kubernetes 1.35 sources), so a client
that passes here is not refused there for the same reason:

- Events: ``ValidateEventCreate``/``ValidateEventUpdate`` and ``legacyValidateEvent``,
  kubernetes pkg/apis/core/validation/events.go
  (https://github.com/kubernetes/kubernetes/blob/master/pkg/apis/core/validation/events.go);
  the errors as ``errors.NewInvalid`` writes them (apimachinery pkg/api/errors/errors.go,
  pkg/util/validation/field/errors.go).
- DeviceTaintRules: ``validateDeviceTaint``, kubernetes
  pkg/apis/resource/validation/validation.go.
- Patches: RFC 7386 merge patch; a strategic merge patch merges a list by its
  ``patchMergeKey`` (k8s.io/api core/v1/types.go, ``NodeStatus.Conditions``).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

FieldPath = tuple[str, ...]

# pkg/apis/core/validation/events.go: ReportingInstanceLengthLimit, ActionLengthLimit,
# ReasonLengthLimit (128) and NoteLengthLimit (1024). Go's len() counts bytes.
LENGTH_LIMIT = 128
NOTE_LIMIT = 1024
# metav1.MicroTime is parsed with RFC3339Micro, "2006-01-02T15:04:05.000000Z07:00"
# (apimachinery pkg/apis/meta/v1/micro_time.go:26,125): exactly six fraction digits.
_MICRO_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}(Z|[+-]\d{2}:\d{2})")
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
    "'-' or '.', and must start and end with an alphanumeric character"
)

# Lists a strategic merge patch merges by a key instead of replacing (patchMergeKey in
# k8s.io/api core/v1/types.go): the Node status lists this stand-in serves.
NODE_MERGE_KEYS: dict[FieldPath, str] = {
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
}
# pkg/apis/resource/validation/validation.go, validDeviceTaintEffects (1.35 added None)
DEVICE_TAINT_EFFECTS = ("NoExecute", "NoSchedule", "None")


class Refused(Exception):
    """A request answered with a ``metav1.Status`` error."""

    def __init__(self, code: int, reason: str, message: str, details: Any = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def response(self) -> web.Response:
        body = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return web.json_response(body, status=self.code)


def now_rfc3339() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def get_path(obj: Any, *path: str) -> Any:
    for part in path:
        obj = obj.get(part) if isinstance(obj, Mapping) else None
    return obj


def str_at(obj: Any, *path: str) -> str:
    value = get_path(obj, *path)
    return value if isinstance(value, str) else ""


# -- validation: the real server's rules and messages ---------------------------------

_FieldError = tuple[str, str]  # (field, "field: body") as field.Error.Error() writes it


def _required(path: str) -> _FieldError:
    return path, f"{path}: Required value"


def _invalid(path: str, value: Any, detail: str) -> _FieldError:
    shown = json.dumps(value) if not isinstance(value, int | float | bool) else str(value)
    return path, f"{path}: Invalid value: {shown}: {detail}"


def invalid_error(kind: str, group: str, name: str, errors: Sequence[_FieldError]) -> Refused:
    """``errors.NewInvalid`` (apimachinery pkg/api/errors/errors.go): 422, reason
    Invalid, the field errors aggregated as ``[a, b]`` (one without brackets)."""
    texts = list(dict.fromkeys(text for _, text in errors))
    joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    causes = [
        {"reason": "FieldValueInvalid", "message": text.split(": ", 1)[1], "field": path}
        for path, text in errors
    ]
    details = {"name": name, "group": group, "kind": kind, "causes": causes}
    return Refused(422, "Invalid", f'{kind}.{group} "{name}" is invalid: {joined}', details)


def bad_request(message: str) -> Refused:
    return Refused(400, "BadRequest", message)


def not_found(resource: str, name: str) -> Refused:
    return Refused(404, "NotFound", f'{resource} "{name}" not found')


def _name_errors(name: str) -> list[_FieldError]:
    """ValidateObjectMeta's name rule with NameIsDNSSubdomain."""
    if not name:
        return [
            ("metadata.name", "metadata.name: Required value: name or generateName is required")
        ]
    if len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        return [_invalid("metadata.name", name, _SUBDOMAIN_MSG)]
    return []


def _legacy_event_errors(event: Mapping[str, Any]) -> list[_FieldError]:
    """``legacyValidateEvent`` (events.go): run on every create and update. Field paths
    are the core Event's (``involvedObject``, ``message``), as the server reports them."""
    errors: list[_FieldError] = []
    namespace = str_at(event, "metadata", "namespace")
    regarding_ns = str_at(event, "regarding", "namespace")
    if not get_path(event, "eventTime"):
        if (not regarding_ns and namespace not in ("", "default")) or (
            regarding_ns and namespace != regarding_ns
        ):
            errors.append(
                _invalid("involvedObject.namespace", regarding_ns, "does not match event.namespace")
            )
    else:
        if not regarding_ns and namespace not in ("default", "kube-system"):
            errors.append(
                _invalid("involvedObject.namespace", regarding_ns, "does not match event.namespace")
            )
        controller = str_at(event, "reportingController")
        if not controller:
            errors.append(_required("reportingController"))
        elif not _qualified_name(controller):
            errors.append(_invalid("reportingController", controller, "must be a qualified name"))
        instance = str_at(event, "reportingInstance")
        if not instance:
            errors.append(_required("reportingInstance"))
        if len(instance.encode()) > LENGTH_LIMIT:
            errors.append(
                _invalid("reportingInstance", "", f"can have at most {LENGTH_LIMIT} characters")
            )
        for key in ("action", "reason"):
            value = str_at(event, key)
            if not value:
                errors.append(_required(key))
            if len(value.encode()) > LENGTH_LIMIT:
                errors.append(_invalid(key, "", f"can have at most {LENGTH_LIMIT} characters"))
        if len(str_at(event, "note").encode()) > NOTE_LIMIT:
            errors.append(_invalid("message", "", f"can have at most {NOTE_LIMIT} characters"))
    if len(namespace) > 253 or not _DNS_SUBDOMAIN.fullmatch(namespace):
        errors.append(_invalid("namespace", namespace, _SUBDOMAIN_MSG))
    return errors


def _qualified_name(value: str) -> bool:
    """``validation.IsQualifiedName``: an optional DNS-subdomain prefix and ``/``, then
    a name of at most 63 characters."""
    prefix, _, name = value.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return False
    return 0 < len(name) <= 63 and _QUALIFIED_NAME.fullmatch(name) is not None


def _series_errors(event: Mapping[str, Any]) -> list[_FieldError]:
    """``validateV1EventSeries`` (events.go)."""
    series = get_path(event, "series")
    if series is None:
        return []
    errors: list[_FieldError] = []
    count = get_path(series, "count")
    if not isinstance(count, int) or count < 2:
        errors.append(_invalid("series.count", "", "should be at least 2"))
    if not get_path(series, "lastObservedTime"):
        errors.append(_required("series.lastObservedTime"))
    return errors


def event_create_errors(event: Mapping[str, Any]) -> list[_FieldError]:
    """``ValidateEventCreate`` for a request to events.k8s.io/v1 (events.go): the legacy
    rules, then metadata, series, ``eventTime`` required, ``type`` Normal or Warning,
    and the deprecated core fields unset. Nothing there requires ``regarding``: an Event
    without one is accepted in ``default`` or ``kube-system`` (the namespace rule)."""
    errors = _legacy_event_errors(event)
    errors += _name_errors(str_at(event, "metadata", "name"))
    errors += _series_errors(event)
    if not get_path(event, "eventTime"):
        errors.append(_required("eventTime"))
    kind = get_path(event, "type")
    if kind not in ("Normal", "Warning"):
        errors.append(_invalid("type", "", f"has invalid value: {kind or ''}"))
    for v1_name, core_name in (
        ("deprecatedFirstTimestamp", "firstTimestamp"),
        ("deprecatedLastTimestamp", "lastTimestamp"),
        ("deprecatedCount", "count"),
    ):
        if get_path(event, v1_name):
            errors.append(_invalid(core_name, "", "needs to be unset"))
    if str_at(event, "deprecatedSource", "component") or str_at(event, "deprecatedSource", "host"):
        errors.append(_invalid("source", "", "needs to be unset"))
    return errors


# The fields ValidateEventUpdate holds immutable (events.go), v1 name -> core name.
_IMMUTABLE_EVENT_FIELDS = (
    ("regarding", "involvedObject"),
    ("reason", "reason"),
    ("note", "message"),
    ("deprecatedSource", "source"),
    ("deprecatedFirstTimestamp", "firstTimestamp"),
    ("deprecatedLastTimestamp", "lastTimestamp"),
    ("deprecatedCount", "count"),
    ("type", "type"),
    ("eventTime", "eventTime"),
    ("action", "action"),
    ("related", "related"),
    ("reportingController", "reportingController"),
    ("reportingInstance", "reportingInstance"),
)


def event_update_errors(new: Mapping[str, Any], old: Mapping[str, Any]) -> list[_FieldError]:
    """``ValidateEventUpdate`` for events.k8s.io/v1 (events.go): only ``series`` (and
    metadata other than name and namespace) may change; a changed series is checked."""
    errors = _legacy_event_errors(new)
    for key in ("name", "namespace", "uid"):
        if get_path(new, "metadata", key) != get_path(old, "metadata", key):
            errors.append(
                _invalid(f"metadata.{key}", get_path(new, "metadata", key), "field is immutable")
            )
    if get_path(new, "series") != get_path(old, "series"):
        errors += _series_errors(new)
    for v1_name, core_name in _IMMUTABLE_EVENT_FIELDS:
        if get_path(new, v1_name) != get_path(old, v1_name):
            errors.append(_invalid(core_name, get_path(new, v1_name), "field is immutable"))
    return errors


def micro_time_error(event: Mapping[str, Any]) -> str | None:
    """The decode error for a MicroTime that is not RFC3339Micro (a 400, not a 422)."""
    for path in (("eventTime",), ("series", "lastObservedTime")):
        value = get_path(event, *path)
        if value is not None and not (isinstance(value, str) and _MICRO_TIME.fullmatch(value)):
            return (
                f'Event in version "v1" cannot be handled as a Event: {".".join(path)}: '
                f'parsing time {json.dumps(value)} as "2006-01-02T15:04:05.000000Z07:00"'
            )
    return None


def device_taint_rule_errors(rule: Mapping[str, Any]) -> list[_FieldError]:
    """What ``ValidateDeviceTaintRule`` checks that a writer can get wrong
    (pkg/apis/resource/validation/validation.go, ``validateDeviceTaint``): the name, the
    taint key (a label name), the value (a label value: at most 63 characters of
    ``[-A-Za-z0-9_.]``, alphanumeric at both ends) and the effect."""
    errors = _name_errors(str_at(rule, "metadata", "name"))
    taint = get_path(rule, "spec", "taint")
    key = str_at(taint, "key")
    if not key:
        errors.append(_required("spec.taint.key"))
    elif not _qualified_name(key):
        errors.append(_invalid("spec.taint.key", key, "must be a qualified name"))
    value = str_at(taint, "value")
    if value and (len(value) > 63 or not _QUALIFIED_NAME.fullmatch(value)):
        errors.append(_invalid("spec.taint.value", value, "must be a valid label value"))
    effect = str_at(taint, "effect")
    if not effect:
        errors.append(_required("spec.taint.effect"))
    elif effect not in DEVICE_TAINT_EFFECTS:
        supported = ", ".join(f'"{e}"' for e in DEVICE_TAINT_EFFECTS)
        errors.append(
            (
                "spec.taint.effect",
                f'spec.taint.effect: Unsupported value: "{effect}": supported values: {supported}',
            )
        )
    return errors


# -- patches ---------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge, ``null`` deletes, anything else
    (lists included) replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(
    target: Any,
    patch: Any,
    merge_keys: Mapping[FieldPath, str],
    path: FieldPath = (),
) -> Any:
    """A strategic merge patch for the fields this stand-in serves: like
    ``merge_patch``, except that a list named in ``merge_keys`` merges element by element
    on that key (an element of the patch replaces fields of the one with the same key,
    or is appended), and an element ``{"$patch": "delete", key: ...}`` removes one."""
    if not isinstance(patch, Mapping):
        if isinstance(patch, list) and path in merge_keys and isinstance(target, list):
            return _merge_list(target, patch, merge_keys[path])
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = strategic_merge_patch(result.get(key), value, merge_keys, (*path, key))
    return result


def _merge_list(target: list[Any], patch: list[Any], key: str) -> list[Any]:
    result = [copy.deepcopy(item) for item in target]
    for item in patch:
        if not isinstance(item, Mapping):
            continue
        at = next((i for i, old in enumerate(result) if get_path(old, key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if at is not None:
                del result[at]
        elif at is None:
            result.append(copy.deepcopy(dict(item)))
        else:
            result[at] = merge_patch(result[at], item)
    return result
