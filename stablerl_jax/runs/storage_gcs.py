"""What is particular to Cloud Storage under storage.py. Its naming rules (`check_url`) are
checked on every `gs://` URL entering storage.py: a misspelt one is refused, naming itself and
the fix, before any request. google-cloud-storage's client (following STORAGE_EMULATOR_HOST, as
gcsfs does: tests/runs/gcs_test.py runs against a local emulator) makes the run's first request
(`bucket_exists`, the workdir check, given up within REACH_BOUND_S when the endpoint does not
answer) and those gcsfs cannot: the object-store run lock's (lock.py) writes under generation
preconditions (`read_object`, `create_object`, `replace_object`, `delete_object`)."""
from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import os
import re
import warnings
from typing import NamedTuple

# `bucket_exists`: each request waits REACH_TIMEOUT_S at most, and no retry starts after
# REACH_DEADLINE_S, so it ends within REACH_BOUND_S.
REACH_TIMEOUT_S = 5.0
REACH_DEADLINE_S = 10.0
REACH_BOUND_S = REACH_DEADLINE_S + REACH_TIMEOUT_S
EXAMPLE_URL = "gs://my-runs/run1"


class BadURL(OSError):
    """A `gs://` URL naming no possible bucket or object (`check_url`); an OSError, as a missing
    path's FileNotFoundError, for one-line reports (experiments/cli_errors.py)."""


# Cloud Storage's naming rules, https://cloud.google.com/storage/docs/buckets#naming:
# lowercase letters, digits, dashes, underscores and dots; a letter or digit first and
# last; 3-63 characters, or up to 222 with dots, each dot-separated part up to 63; not an
# IP address in dotted-decimal notation; no "goog" prefix and no "google" inside.
_BUCKET_CHARS = re.compile(r"[a-z0-9][a-z0-9._-]*[a-z0-9]")
# https://cloud.google.com/storage/docs/objects#naming: an object name is valid UTF-8 of
# 1-1024 bytes, holds no carriage return or line feed, and is not "." or "..". The other
# control characters are refused too: the naming page advises against them, and typed
# into a path they are a mistake.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_OBJECT_MAX_BYTES = 1024


def _bucket_problem(bucket: str) -> str | None:
    """What Cloud Storage's naming rules refuse in the bucket name, or None."""
    if not bucket:
        return "no bucket name after gs://"
    bad = f"bucket name {bucket!r} "
    parts = bucket.split(".")
    if not 3 <= len(bucket) <= (222 if len(parts) > 1 else 63):
        return bad + "is not 3-63 characters long (up to 222 with dots)"
    if not _BUCKET_CHARS.fullmatch(bucket):
        return bad + ("may hold only lowercase letters, digits, '-', '_' and '.', and must "
                      "start and end with a letter or digit")
    if any(not 1 <= len(part) <= 63 for part in parts):
        return bad + "has an empty dot-separated part or one over 63 characters"
    try:
        ipaddress.IPv4Address(bucket)
        return bad + "is an IP address"
    except ValueError:
        pass
    if bucket.startswith("goog") or "google" in bucket:
        return bad + "starts with 'goog' or holds 'google', which Cloud Storage reserves"
    return None


def _object_problem(name: str) -> str | None:
    """What Cloud Storage refuses in the object path (`name`, trailing '/' allowed), or None."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "the object path is not valid Unicode"
    if size > _OBJECT_MAX_BYTES:
        return f"the object path is {size} bytes long, over Cloud Storage's 1024"
    if (m := _CONTROL.search(name)):
        return f"the object path holds the control character {m.group()!r}"
    segments = name.removesuffix("/").split("/")
    if name and "" in segments:
        return "the object path holds an empty segment (a double slash)"
    if {".", ".."} & set(segments):
        return "the object path holds a '.' or '..' segment"
    return None


def check_url(path, what: str = "") -> None:
    """A BadURL naming `what` (the setting), the URL, the problem and a good URL, for a `path`
    that is a `gs://` URL outside Cloud Storage's naming rules, a `gs:` misspelling (`gs:/x`,
    `gs:bucket`), or one with whitespace around it. Anything else passes."""
    s = str(path)
    stripped = s.strip()
    if not stripped.startswith("gs:"):
        return
    head = f"{what} {s!r}" if what else repr(s)
    if stripped != s:
        raise BadURL(f"{head}: whitespace around the URL; pass it without, e.g. "
                     f"{stripped!r}")
    if not s.startswith("gs://"):
        fixed = "gs://" + s.removeprefix("gs:").lstrip("/")
        raise BadURL(f"{head}: a gs URL starts with gs:// (two slashes); e.g. {fixed!r} "
                     f"(or ./{s} for a local path)")
    bucket, _, name = s.removeprefix("gs://").partition("/")
    problem = _bucket_problem(bucket) or _object_problem(name)
    if problem:
        raise BadURL(f"{head}: {problem}; write gs://BUCKET/PATH, e.g. {EXAMPLE_URL}")



# Objects under generation preconditions (the run lock). A generation numbers each
# version of an object; a write that names the generation it expects fails, changing
# nothing, when another write came first: that is what makes a create-if-absent and a
# compare-and-swap of one small object safe between hosts.

class Object(NamedTuple):
    data: bytes
    generation: int
    updated: float  # when the store wrote this version (its clock), seconds since epoch


@functools.cache
def _client(emulator: str | None):
    """The google-cloud-storage client for `emulator` (STORAGE_EMULATOR_HOST, read when made)."""
    from google.cloud import storage as gcs
    try:
        return gcs.Client()
    except Exception as e:  # noqa: BLE001 (google.auth's DefaultCredentialsError and kin)
        raise PermissionError(
            f"gs://: no Google Cloud credentials ({' '.join(str(e).split())[:200]}); run "
            "`gcloud auth application-default login`, or run on a VM whose service "
            "account may write the bucket") from None


def _blob(p: str):
    check_url(p)
    bucket, _, name = str(p).removeprefix("gs://").partition("/")
    return _client(os.environ.get("STORAGE_EMULATOR_HOST")).bucket(bucket).blob(name)


# The loggers of the libraries under google-cloud-storage (the client, google.auth,
# google.api_core's retries, requests' urllib3).
_LIBRARY_LOGGERS = ("google", "urllib3")


@contextlib.contextmanager
def _quiet_libraries():
    """Keep the storage libraries' log records and warnings off the terminal in the block."""
    loggers = [logging.getLogger(name) for name in _LIBRARY_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.CRITICAL + 1)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def _reason(e: BaseException) -> str:
    """Innermost OS-level reason in `e`'s chain ('Connection refused'), else innermost error."""
    chain = []
    while e is not None and all(e is not c for c in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    for c in reversed(chain):
        if isinstance(c, OSError) and isinstance(c.strerror, str) and c.strerror:
            return c.strerror
    return type(chain[-1]).__name__


def bucket_exists(p: str, what: str) -> bool:
    """Whether the bucket of the gs:// URL `p` (setting `what`) exists and this account may see
    it; retried while the store does not answer, for REACH_BOUND_S at most, then a
    ConnectionError naming the endpoint (and STORAGE_EMULATOR_HOST where set) and the fix.
    Retried requests' log records stay quiet (`_quiet_libraries`)."""
    import google.auth.exceptions
    import requests
    from google.api_core import exceptions as gexc
    from google.cloud.storage.retry import DEFAULT_RETRY
    check_url(p, what)
    bucket = str(p).removeprefix("gs://").partition("/")[0]
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    retry = DEFAULT_RETRY.with_timeout(REACH_DEADLINE_S).with_delay(initial=0.5, maximum=4.0)
    try:
        with _quiet_libraries():
            client = _client(emulator)
            return _calling(p, lambda: client.bucket(bucket).exists(
                timeout=REACH_TIMEOUT_S, retry=retry))
    except (gexc.RetryError, requests.exceptions.RequestException,
            google.auth.exceptions.TransportError) as e:
        where = (f"the storage emulator at {emulator} (STORAGE_EMULATOR_HOST)" if emulator
                 else f"Cloud Storage at {client.api_endpoint}")
        fix = ("start the emulator there, or fix or unset STORAGE_EMULATOR_HOST" if emulator
               else "check this machine's network access to it (DNS, proxy, firewall), or "
                    "use a local path")
        raise ConnectionError(f"{what} {str(p)!r}: no answer from {where} within "
                              f"{REACH_BOUND_S:g} s ({_reason(e)}); {fix}") from e


def _calling(p: str, fn):
    """Run a request on the object `p`, its errors as the OSError a user can act on."""
    from google.api_core import exceptions as gexc
    try:
        return fn()
    except (gexc.Forbidden, gexc.Unauthorized) as e:
        raise PermissionError(f"{p}: {e.message}; give this account write access to the "
                              "bucket, or use another workdir") from None
    except gexc.NotFound as e:
        raise FileNotFoundError(f"{p}: {e.message}; check the bucket's name") from None


def read_object(p: str) -> Object | None:
    """The object at `p` with its generation, or None if there is none."""
    from google.api_core import exceptions as gexc
    ref = _blob(p)
    while True:
        blob = _calling(p, lambda: ref.bucket.get_blob(ref.name))
        if blob is None:
            return None
        try:
            data = _calling(p, lambda: blob.download_as_bytes(
                if_generation_match=blob.generation))
        except (gexc.PreconditionFailed, FileNotFoundError):
            continue  # rewritten or deleted between the two requests: read again
        return Object(data, int(blob.generation), blob.updated.timestamp())


def create_object(p: str, data: bytes) -> int | None:
    """Write `p` if no object is there; its generation, or None if one was."""
    from google.api_core import exceptions as gexc
    blob = _blob(p)
    try:
        _calling(p, lambda: blob.upload_from_string(data, if_generation_match=0))
    except gexc.PreconditionFailed:
        return None
    return int(blob.generation)


def replace_object(p: str, data: bytes, generation: int) -> int | None:
    """Rewrite `p` if still at `generation`: the new generation, or None (nothing written)."""
    from google.api_core import exceptions as gexc
    blob = _blob(p)
    try:
        _calling(p, lambda: blob.upload_from_string(data, if_generation_match=generation))
    except (gexc.PreconditionFailed, FileNotFoundError):
        return None
    return int(blob.generation)


def delete_object(p: str, generation: int) -> bool:
    """Delete `p` if it is still at `generation`; whether it was."""
    from google.api_core import exceptions as gexc
    try:
        _calling(p, lambda: _blob(p).delete(if_generation_match=generation))
    except (gexc.PreconditionFailed, FileNotFoundError):
        return False
    return True
