"""``tensorstore-hooks inspect URL [URL ...]``: list what ZarrStore roots hold, read-only.

Reads the root's ``zarr.json``, finds the namespaces (one per writer) and replays each
namespace's index (``index/snapshot`` + ``index/journal``) to list every key with its
dtype, shape and size. Nothing is written: the store is not opened as a
:class:`~tensorstore_hooks.ZarrStore` (which would create its layout and a namespace
of its own); the index is read through the same I/O layer instead.

Several URLs (or ``--config FILE`` with ``store.tiers``) are the tiers of a chain,
fastest first: each tier is listed, and a namespace found in several tiers (the Zarr
tiers of one chain share its name) is shown with what each tier holds of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, NotRequired, TypeAlias, TypedDict, final

if TYPE_CHECKING:
    from tensorstore_hooks.storage.io import ChunkIO

__all__ = [
    "JSON",
    "CapturedArray",
    "ChainListing",
    "ChainNamespace",
    "ChainTotals",
    "KeyListing",
    "NamespaceListing",
    "RootListing",
    "RootTotals",
    "StorageOptions",
    "inspect_chain",
    "inspect_root",
    "register",
    "run",
]

JSON: TypeAlias = "str | int | float | bool | list[JSON] | dict[str, JSON] | None"
"""A value read from a JSON document (``zarr.json`` attributes)."""

StorageOptions: TypeAlias = "dict[str, object]"
"""fsspec storage options, passed on to the filesystem as they are."""


class KeyListing(TypedDict):
    """One stored tensor of a namespace."""

    key: str
    dtype: str
    shape: list[int]
    stride: list[int]
    device: str
    framework: str
    nbytes: int
    stored_bytes: int
    """Whole chunks: payload plus padding, before the codec."""


class NamespaceListing(TypedDict):
    """One namespace (one writer) of a root; ``format``, ``chunk_bytes`` and ``codec``
    are as its ``zarr.json`` says (``None`` where it says nothing)."""

    name: str
    format: JSON
    chunk_bytes: JSON
    codec: JSON
    tensors: int
    bytes: int
    stored_bytes: int
    keys: list[KeyListing]
    damage: list[str]
    """The damaged index records (the rest is listed)."""
    damaged_docs: list[str]
    """Its ``zarr.json`` when it cannot be parsed: named, with how to recover."""
    error: str | None
    """Why the namespace could not be listed at all."""


class CapturedArray(TypedDict):
    """An array ``tsh.capture`` wrote under ``ROOT/capture``."""

    name: str
    shape: list[int]
    dtype: str
    chunk_rows: int
    bytes: int


class RootTotals(TypedDict):
    namespaces: int
    tensors: int
    bytes: int
    stored_bytes: int


@final
class RootListing(TypedDict):
    """What :func:`inspect_root` returns (and ``inspect --json`` prints)."""

    url: str
    format: JSON
    direct_io: str | None
    """Whether the root's filesystem takes O_DIRECT; ``None``: not a local directory."""
    namespaces: list[NamespaceListing]
    capture: list[CapturedArray]
    totals: RootTotals
    problems: list[str]
    """Every damaged record and unlisted namespace, one line each."""
    tier: NotRequired[int]
    """A chain's tier: its position, fastest first."""
    budget: NotRequired[int | None]
    """A chain's tier: its budget from the config, bytes."""


class ChainNamespace(TypedDict):
    """A namespace of a chain, with what each tier holds of it."""

    name: str
    tensors: list[int]
    bytes: list[int]


class ChainTotals(TypedDict):
    tensors: int
    bytes: int
    stored_bytes: int


@final
class ChainListing(TypedDict):
    """What :func:`inspect_chain` returns (and ``inspect --json`` prints for a chain)."""

    tiers: list[RootListing]
    namespaces: list[ChainNamespace]
    totals: ChainTotals
    problems: list[str]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``inspect`` subcommand."""
    parser = subparsers.add_parser(
        "inspect",
        help="list the namespaces and tensors a store holds (read-only)",
        description=(
            "List every namespace of a ZarrStore root (a local path, file://, or an fsspec "
            "URL such as s3://bucket/prefix) and every key in it with dtype, shape and "
            "bytes, with totals, and the arrays tsh.capture wrote. Several URLs are the "
            "tiers of a chain, fastest first (or --config FILE with store.tiers): each "
            "tier is listed, and what each holds of the chain's namespaces. Read-only. "
            "For the storage daemon (tsh://) use "
            "`tensorstore-hooks stats URL`."
        ),
    )
    parser.add_argument(
        "url",
        metavar="URL",
        nargs="*",
        help="store root: PATH, file://PATH, s3://bucket/prefix, ...; several: a tier chain",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="take the URL (store.url) or the chain (store.tiers, with budgets and each "
        "tier's storage_options) from this YAML config instead",
    )
    parser.add_argument("--json", action="store_true", help="print the listing as JSON")
    parser.add_argument(
        "--storage-options",
        metavar="JSON",
        help="fsspec storage options as JSON, e.g. '{\"anon\": true}'; for a chain one "
        "object for every tier or a list, one per tier",
    )
    parser.set_defaults(func=run)


def inspect_root(
    url: str, storage_options: StorageOptions | None = None, *, empty_ok: bool = False
) -> RootListing:
    """Describe the ZarrStore root at ``url`` without writing to it.

    Returns ``{"url", "format", "direct_io", "capture": [{"name", "shape", "dtype",
    "chunk_rows", "bytes"}], "namespaces": [{"name", "format", "chunk_bytes", "codec",
    "tensors", "bytes", "stored_bytes", "keys": [{"key", "dtype", "shape", "stride",
    "device", "framework", "nbytes", "stored_bytes"}], "damage": [str],
    "damaged_docs": [str], "error": str | None}], "totals": {...}, "problems": [str]}``.
    ``stored_bytes`` counts whole chunks (payload plus padding, before the codec).
    ``damage`` lists the damaged index records of a namespace (the rest is listed),
    ``damaged_docs`` its ``zarr.json`` if it cannot be parsed, ``error`` says why a
    namespace could not be listed at all; ``problems`` gathers them, one line each. Raises
    :class:`~tensorstore_hooks.ConfigError` if ``url`` is not a tensorstore-hooks root;
    with ``empty_ok`` (a chain's tier), a root that has no ``zarr.json`` yet (no store
    ever put a tensor there) is listed with ``format`` ``None`` instead.
    """
    from tensorstore_hooks.storage.zarr import make_io

    # The store's own I/O layer (local files, or fsspec with its retries), without the
    # store: ZarrStore.__init__ would write the root layout and a namespace.
    io = make_io(url, storage_options or {}, retry_deadline_s=30.0)
    try:
        fmt = _root_format(io, empty_ok=empty_ok)
        namespaces = [ns for name in io.listdir("") if (ns := _namespace(io, name)) is not None]
        captured, capture_problems = _captured(io)
    finally:
        io.close()
    totals: RootTotals = {
        "namespaces": len(namespaces),
        "tensors": sum(n["tensors"] for n in namespaces),
        "bytes": sum(n["bytes"] for n in namespaces),
        "stored_bytes": sum(n["stored_bytes"] for n in namespaces),
    }
    problems = [
        f"namespace {n['name']}: damaged: {d}" for n in namespaces for d in n["damaged_docs"]
    ]
    problems += [f"namespace {n['name']}: damaged: {d}" for n in namespaces for d in n["damage"]]
    problems += [f"namespace {n['name']}: damaged: {n['error']}" for n in namespaces if n["error"]]
    problems += capture_problems
    return {
        "url": io.url,
        "format": fmt,
        "direct_io": _direct_io_here(io),
        "namespaces": namespaces,
        "capture": captured,
        "totals": totals,
        "problems": problems,
    }


def _captured(io: ChunkIO) -> tuple[list[CapturedArray], list[str]]:
    """The arrays ``tsh.capture`` wrote under ``ROOT/capture`` (NOTE [ Capture layout ]),
    and one problem line for each whose ``zarr.json`` cannot be used, naming it and how
    to recover (NOTE [ Capture documents ])."""
    from tensorstore_hooks.capture import scan_arrays

    scan = scan_arrays(io)
    arrays: list[CapturedArray] = [
        {
            "name": a.name,
            "shape": [a.rows, *a.row_shape],
            "dtype": a.dtype,
            "chunk_rows": a.chunk_rows,
            "bytes": a.nbytes,
        }
        for a in scan.arrays
    ]
    return arrays, [f"captured array: {d}" for d in scan.damaged]


def _direct_io_here(io: ChunkIO) -> str | None:
    """Whether the root's filesystem takes O_DIRECT, found without writing: ``None``
    for roots that are not local directories (NOTE [ Direct I/O ] in ``storage/io/_local.py``)."""
    from tensorstore_hooks.storage.io import LocalIO, direct_io_readonly_check

    if not isinstance(io, LocalIO):
        return None
    return direct_io_readonly_check(io.root)


def inspect_chain(
    urls: list[str],
    storage_options: list[StorageOptions | None],
    budgets: list[int | None] | None = None,
) -> ChainListing:
    """Describe the tiers of a chain (fastest first) without writing to them.

    Returns ``{"tiers": [inspect_root(url) + {"tier", "budget"}], "namespaces": [{"name",
    "tensors": [per tier], "bytes": [per tier]}], "totals": {...}, "problems": [str]}``.
    A namespace is listed once with what each tier holds of it (a chain gives its Zarr
    tiers one namespace name). ``budgets``: shown beside each tier (from a config).
    """
    from tensorstore_hooks.errors import ConfigError, TensorStoreError

    budgets = budgets or [None] * len(urls)
    tiers = []
    why_not: list[str] = []
    for i, (url, so, budget) in enumerate(zip(urls, storage_options, budgets, strict=True)):
        try:
            # A tier that never received a put (tensors larger than its budget go
            # past it) has no zarr.json: listed as holding nothing, not an error.
            listing = inspect_root(url, so, empty_ok=True)
        except TensorStoreError as e:
            listing = _unlisted_tier(url, str(e))
            why_not.append(f"tier {i} ({url}): {e}")
        listing["tier"] = i
        listing["budget"] = budget
        listing["url"] = url
        tiers.append(listing)
    if all(t["format"] is None for t in tiers):
        raise ConfigError(
            "inspect: none of the chain's tiers is a tensorstore-hooks store root: "
            + "; ".join(why_not or [f"tier {t['tier']} ({t['url']}): no zarr.json" for t in tiers])
        )
    names = sorted({ns["name"] for t in tiers for ns in t["namespaces"]})
    namespaces: list[ChainNamespace] = []
    for name in names:
        found = [next((n for n in t["namespaces"] if n["name"] == name), None) for t in tiers]
        namespaces.append(
            {
                "name": name,
                "tensors": [n["tensors"] if n else 0 for n in found],
                "bytes": [n["bytes"] if n else 0 for n in found],
            }
        )
    totals: ChainTotals = {
        "tensors": sum(t["totals"]["tensors"] for t in tiers),
        "bytes": sum(t["totals"]["bytes"] for t in tiers),
        "stored_bytes": sum(t["totals"]["stored_bytes"] for t in tiers),
    }
    problems = [f"tier {t['tier']} ({t['url']}): {p}" for t in tiers for p in t["problems"]]
    return {"tiers": tiers, "namespaces": namespaces, "totals": totals, "problems": problems}


def _unlisted_tier(url: str, why: str) -> RootListing:
    """A chain's tier that could not be listed: shown with why, beside the others."""
    return {
        "url": url,
        "format": None,
        "direct_io": None,
        "namespaces": [],
        "capture": [],
        "totals": {"namespaces": 0, "tensors": 0, "bytes": 0, "stored_bytes": 0},
        "problems": [f"not listed: {why}"],
    }


def _not_a_root(io: ChunkIO, why: str) -> Exception:
    from tensorstore_hooks.errors import ConfigError

    return ConfigError(
        f"inspect: {io.url} is not a tensorstore-hooks store root: {why} "
        "(pass the directory given to tsh.open_store / tsh.offload)"
    )


def _root_format(io: ChunkIO, *, empty_ok: bool = False) -> JSON:
    """The root's format number, or a ConfigError saying why it is not a root
    (``empty_ok``: ``None`` for a root without a ``zarr.json``, where nothing was
    ever stored)."""
    try:
        raw = bytes(io.read("zarr.json"))
    except FileNotFoundError:
        if empty_ok:
            return None
        raise _not_a_root(io, "it has no zarr.json") from None
    except NotADirectoryError:
        raise _not_a_root(io, "it is a file, not a directory") from None
    except IsADirectoryError:
        raise _not_a_root(io, "its zarr.json is a directory") from None
    except OSError as e:
        raise _not_a_root(io, f"zarr.json cannot be read ({e})") from None
    try:
        doc = json.loads(raw)
    except ValueError as e:  # also UnicodeDecodeError
        raise _not_a_root(io, f"its zarr.json is not JSON ({e})") from None
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    ours = attrs.get("tensorstore_hooks") if isinstance(attrs, dict) else None
    fmt = ours.get("format") if isinstance(ours, dict) else None
    if fmt is None:
        raise _not_a_root(
            io, "its zarr.json has no attributes.tensorstore_hooks.format (a Zarr node?)"
        )
    return fmt


def _namespace(io: ChunkIO, name: str) -> NamespaceListing | None:
    """One namespace's listing (problems recorded in it), or None if ``name`` is not one."""
    from tensorstore_hooks.errors import TensorStoreError
    from tensorstore_hooks.storage.zarr import Entry, IndexLog

    attrs, doc_damage = _namespace_attrs(io, name)
    if attrs is None and not io.exists(f"{name}/index"):
        return None  # not a namespace (e.g. a stray file or someone else's data)
    attrs = attrs or {}
    index = IndexLog(io, f"{name}/index", warn=False)
    keys: list[KeyListing] = []
    error = None
    try:
        records = index.load()
        for key, rec in records.items():
            entry = Entry.from_record(rec)
            m = entry.meta
            keys.append(
                {
                    "key": key,
                    "dtype": m.dtype,
                    "shape": list(m.shape),
                    "stride": list(m.stride),
                    "device": m.device,
                    "framework": m.framework,
                    "nbytes": m.nbytes,
                    "stored_bytes": entry.chunk * entry.count,
                }
            )
    except TensorStoreError as e:
        error = str(e)
    keys.sort(key=lambda k: _key_order(k["key"]))
    return {
        "name": name,
        "format": attrs.get("format"),
        "chunk_bytes": attrs.get("chunk_bytes"),
        "codec": attrs.get("codec"),
        "tensors": len(keys),
        "bytes": sum(k["nbytes"] for k in keys),
        "stored_bytes": sum(k["stored_bytes"] for k in keys),
        "keys": keys,
        "damage": [str(d) for d in index.damage],
        "damaged_docs": doc_damage,
        "error": error,
    }


def _namespace_attrs(io: ChunkIO, name: str) -> tuple[dict[str, JSON] | None, list[str]]:
    """A namespace's attributes from its ``zarr.json`` (``None``: none of ours), and
    the document's damage: one that cannot be parsed is named, with how to recover
    (the store never overwrites it: NOTE [ Atomic documents ])."""
    from tensorstore_hooks.storage.zarr import damaged_doc_advice, read_doc

    path = f"{name}/zarr.json"
    try:
        doc = read_doc(io, path)
    except OSError:
        return None, []
    if doc.error is not None:
        return None, [f"{path} cannot be parsed ({doc.error}); {damaged_doc_advice(io, path)}"]
    attrs = doc.parsed.get("attributes") if doc.parsed is not None else None
    ours = attrs.get("tensorstore_hooks") if isinstance(attrs, dict) else None
    return (ours if isinstance(ours, dict) else None), []


def _key_order(key: str) -> tuple[int, str]:
    # Keys are hex counters: sort numerically (so "a" follows "9"), others after them.
    try:
        return int(key, 16), ""
    except ValueError:
        return 1 << 62, key


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _format(listing: RootListing) -> str:
    from tensorstore_hooks._units import format_bytes as fb
    from tensorstore_hooks.storage.zarr import FORMAT_VERSION

    fmt = listing["format"]
    about = "nothing stored yet: no zarr.json" if fmt is None else f"tensorstore-hooks format {fmt}"
    lines = [f"store {listing['url']}  ({about})"]
    if listing.get("direct_io") is not None:
        lines.append(f"direct I/O: {listing['direct_io']}")
    for ns in listing["namespaces"]:
        chunk = fb(ns["chunk_bytes"]) if isinstance(ns["chunk_bytes"], int) else "?"
        lines.append("")
        fmt = ns.get("format")
        old = "" if fmt in (None, FORMAT_VERSION) else ", not readable by this version"
        lines.append(
            f"namespace {ns['name']}  (format {fmt if fmt is not None else '?'}{old}, "
            f"chunk {chunk}, codec {ns['codec'] or '?'}): "
            f"{_count(ns['tensors'], 'tensor')}, {fb(ns['bytes'])}"
        )
        if ns["error"]:
            lines.append(f"  not listed: {ns['error']}")
        for doc in ns["damaged_docs"]:
            lines.append(f"  DAMAGED document: {doc}")
        if ns["damage"]:
            lines.append(f"  DAMAGED index: {len(ns['damage'])} region(s); the rest is listed")
        if not ns["keys"]:
            continue
        rows = [("key", "dtype", "shape", "bytes", "device")]
        rows += [
            (k["key"], k["dtype"], str(tuple(k["shape"])), fb(k["nbytes"]), _device(k))
            for k in ns["keys"]
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        for r in rows:
            lines.append(
                f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  "
                f"{r[3]:>{widths[3]}}  {r[4]}"
            )
    if listing["capture"]:
        lines += ["", f"captured arrays (capture/): {len(listing['capture'])}"]
        lines += [
            f"  {a['name']}  {a['dtype']}  {tuple(a['shape'])}  {fb(a['bytes'])}"
            for a in listing["capture"]
        ]
    t = listing["totals"]
    lines.append("")
    lines.append(
        f"total: {_count(t['namespaces'], 'namespace')}, {_count(t['tensors'], 'tensor')}, "
        f"{fb(t['bytes'])} "
        f"({fb(t['stored_bytes'])} in whole chunks)"
    )
    return "\n".join(lines)


def _format_chain(listing: ChainListing) -> str:
    from tensorstore_hooks._units import format_bytes as fb

    tiers = listing["tiers"]
    lines = [f"tier chain of {len(tiers)} stores, fastest first"]
    for t in tiers:
        budget = f", budget {fb(t['budget'])}" if t["budget"] is not None else ""
        held = f"{_count(t['totals']['tensors'], 'tensor')}, {fb(t['totals']['bytes'])}"
        if t["format"] is None:
            held = "not listed" if t["problems"] else f"{held} (nothing stored there yet)"
        lines.append(f"  tier {t['tier']}: {t['url']}{budget}: {held}")
    for ns in listing["namespaces"]:
        where = ", ".join(
            f"tier {i} {n} ({fb(b)})"
            for i, (n, b) in enumerate(zip(ns["tensors"], ns["bytes"], strict=True))
        )
        lines.append(f"  namespace {ns['name']}: {where}")
    for t in tiers:
        lines += ["", f"--- tier {t['tier']} ---", _format(t)]
    return "\n".join(lines)


def _targets(
    args: argparse.Namespace,
) -> tuple[list[str], list[StorageOptions | None], list[int | None] | None] | str:
    """The URLs to list, their storage options and budgets; or why there are none."""
    urls: list[str] = list(args.url)
    if args.config is not None:
        if urls:
            return "give URLs or --config, not both"
        from tensorstore_hooks.config import load_config

        store = load_config(args.config).store  # a ConfigError names the file and field
        if store.tiers:
            return (
                [t.url for t in store.tiers],
                [
                    t.storage_options if t.storage_options is not None else store.storage_options
                    for t in store.tiers
                ],
                [t.budget for t in store.tiers],
            )
        if store.url is None:
            return f"{args.config} names no store (store.url or store.tiers)"
        return [store.url], [store.storage_options], None
    if not urls:
        return "give a store URL (several: a tier chain), or --config FILE"
    try:
        options = json.loads(args.storage_options) if args.storage_options else None
    except json.JSONDecodeError as e:
        return f"--storage-options is not valid JSON: {e}"
    if isinstance(options, list):
        if len(options) != len(urls):
            return f"--storage-options has {len(options)} entries for {len(urls)} URLs"
        return urls, options, None
    return urls, [options] * len(urls), None


def run(args: argparse.Namespace) -> int:
    """List the store at ``args.url`` (several: a chain); exit 0, or 1 with the reason on
    stderr (one line per problem: a root cannot be read, or an index is damaged; never
    a traceback)."""
    from tensorstore_hooks.cli import error_line
    from tensorstore_hooks.errors import TensorStoreError
    from tensorstore_hooks.storage import DAEMON_SCHEMES, scheme_of

    try:
        targets = _targets(args)
    except TensorStoreError as e:
        print(f"inspect: {_one_line(str(e))}", file=sys.stderr)
        return 1
    if isinstance(targets, str):
        print(f"inspect: {targets}", file=sys.stderr)
        return 1
    urls, options, budgets = targets
    for url in urls:
        scheme = scheme_of(url)
        if scheme in DAEMON_SCHEMES:
            print(
                f"inspect: {url} is a storage daemon; its sessions and tiers are shown by "
                f"`tensorstore-hooks stats {url}`",
                file=sys.stderr,
            )
            return 1
        if scheme == "memory":
            print(
                f"inspect: {url}: a memory:// store is private to the process that opened it; "
                "there is nothing to inspect from outside",
                file=sys.stderr,
            )
            return 1
    listing: RootListing | ChainListing
    try:
        if len(urls) == 1:
            listing = inspect_root(urls[0], options[0])
        else:
            listing = inspect_chain(urls, options, budgets)
    except TensorStoreError as e:
        print(error_line("inspect", e), file=sys.stderr)
        return 1
    except Exception as e:  # never a traceback for a store we cannot read
        why = f"{type(e).__name__}: {_one_line(str(e))}"
        print(f"inspect: cannot read {' '.join(urls)}: {why}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(listing, indent=1))
    elif "tiers" in listing:
        print(_format_chain(listing))
    else:
        print(_format(listing))
    for problem in listing["problems"]:  # each says what it is (damaged, not listed)
        print(f"inspect: {_one_line(problem)}", file=sys.stderr)
    return 1 if listing["problems"] else 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _device(k: KeyListing) -> str:
    """``cpu``; a tensor stored from another framework says which (``cpu (paddle)``)."""
    return k["device"] if k["framework"] == "torch" else f"{k['device']} ({k['framework']})"
