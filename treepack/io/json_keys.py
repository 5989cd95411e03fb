"""JSON objects that name a key twice. Python's json keeps the last value and simdjson the first, so such a
record has no one reading: both JSON paths of `treepack.io.jsonl` make it the record's error."""

from __future__ import annotations


class Duplicated(dict):
    """A parsed object that named ``key`` twice (kept so the record's error can name it)."""

    __slots__ = ("key",)


def pairs_to_dict(pairs: list) -> dict:
    """``json``'s ``object_pairs_hook``: a dict, or a `Duplicated` one naming the first repeated key."""
    d = dict(pairs)
    if len(d) == len(pairs):
        return d
    seen, out = set(), Duplicated(d)
    out.key = next(k for k, _ in pairs if k in seen or seen.add(k))
    return out


def repeated_key(value) -> str | None:
    """The first key named twice in an object of a value parsed with `pairs_to_dict`, at any depth."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, Duplicated):
            return v.key
        if isinstance(v, dict):
            stack.extend(x for x in v.values() if isinstance(x, (dict, list)))
        elif isinstance(v, list):
            stack.extend(x for x in v if isinstance(x, (dict, list)))
    return None


def repeats_a_key(obj, skip: tuple = ()) -> bool:
    """Whether a simdjson value holds an object that names a key twice, at any depth, without leaving the
    fast path; the top-level fields in ``skip`` (the flat number lists, checked by their own parse) are not
    walked."""
    import simdjson

    containers = (simdjson.Object, simdjson.Array)
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, simdjson.Object):
            keys = list(v.keys())
            if len(set(keys)) != len(keys):
                return True
            stack.extend(x for k in keys if (v is not obj or k not in skip) and isinstance(x := v[k], containers))
        else:
            stack.extend(x for x in v if isinstance(x, containers))
    return False
