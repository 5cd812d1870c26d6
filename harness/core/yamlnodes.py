"""Line-aware reading of YAML config files (stages.yaml, targets.yaml, baselines.yaml, …): the
composed node tree keeps each value's line, so every problem is one line naming file, line, key.

`read_file` / `compose` return a bounded node tree or raise the context's error as one line,
whatever the bytes:
- at most MAX_ALIASES aliases standing for MAX_ALIAS_NODES nodes in all (a billion-laughs bomb
  is refused in milliseconds), no alias inside its own anchor;
- nesting deeper than MAX_DEPTH, more than MAX_NODES values or MAX_BYTES are refused early;
- non-UTF-8 bytes, characters YAML forbids, tags other than YAML's plain ones (`!!python/…`,
  `!!binary`, merge keys `<<`), non-plain mapping keys and values that cannot be built (a
  5000-digit integer, `2024-13-45`) are each one line naming where they are.
So `scalar`, `kind` and `mapping` never raise on a tree from `compose`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer, ComposerError
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.resolver import Resolver

try:  # libyaml's scanner and parser (about 7x faster); our own composer runs on its events either way
    from yaml.cyaml import CParser as _CParser
except ImportError:  # pragma: no cover — PyYAML built without libyaml
    _CParser = None


TOP = "(top level)"  # the key shown for a problem with the document itself

MAX_ALIASES = 100  # aliases (`*name`) in one file
MAX_ALIAS_NODES = 10_000  # nodes the aliases stand for, counted as if written out
MAX_DEPTH = 64  # nested mappings/lists
MAX_NODES = 100_000  # values written in one file (composing takes ~15 µs a value)
MAX_BYTES = 4 * 1024 * 1024  # a config file larger than this is refused unread

_T = "tag:yaml.org,2002:"
MAP_TAG, SEQ_TAG = _T + "map", _T + "seq"
SCALAR_TAGS = {_T + n: n for n in ("null", "bool", "int", "float", "str", "timestamp")}
_WHAT = {"null": "empty value", "bool": "boolean", "int": "integer", "float": "number", "str": "string",
         "timestamp": "date"}


class NodeContext:
    """Which file is being read (as shown in messages), and which error a problem raises."""

    def __init__(self, display: str, error: type[Exception], mapping_hint: str = ""):
        self.display = display
        self.error = error
        self.mapping_hint = mapping_hint

    def fail(self, node: Node | None, key: str, problem: str) -> Exception:
        return self.fail_at(node.start_mark.line + 1 if node is not None else 1, key, problem)

    def fail_at(self, line: int, key: str | None, problem: str) -> Exception:
        """The error for a problem at `line` (1-based); `key` None for a problem of the text itself."""
        where = f"{one_line(key, 200)}: " if key else ""
        return self.error(f"{self.display}:{line}: {where}{one_line(problem, 600)}")

    def line(self, node: Node) -> str:
        return f"{self.display}:{node.start_mark.line + 1}"


def one_line(text: str, limit: int) -> str:
    """`text` with control characters escaped, cut to `limit` characters: a message stays one line."""
    out = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
    return out if len(out) <= limit else out[: limit - 1] + "…"


# ---------------------------------------------------------------------------------------
# Reading and composing.


class _Refused(Exception):
    def __init__(self, line: int, problem: str):
        super().__init__(problem)
        self.line = line
        self.problem = problem


class _BoundedComposer(Composer):
    """PyYAML's composer, counting values, aliases (and what they stand for) and nesting depth.
    Mixed in before a parser, which supplies the events."""

    def _bound(self, max_nodes: int) -> None:
        self._max_nodes = max_nodes
        self._nodes = 0
        self._aliases = 0
        self._alias_nodes = 0
        self._depth = 0
        self._sizes: dict[int, int] = {}  # id(node) -> its node count, aliases written out

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            line = event.start_mark.line + 1
            target = self.anchors.get(event.anchor)
            if target is None:
                raise ComposerError(None, None, f"found undefined alias {event.anchor!r}", event.start_mark)
            size = self._sizes.get(id(target))
            if size is None:
                raise _Refused(line, f"alias *{event.anchor} is inside its own anchor (a cycle) — write the values out")
            self._aliases += 1
            self._alias_nodes += size
            if self._aliases > MAX_ALIASES:
                raise _Refused(line, f"more than {MAX_ALIASES} YAML aliases (*name) — write the values out")
            if self._alias_nodes > MAX_ALIAS_NODES:
                raise _Refused(line, f"YAML aliases stand for more than {MAX_ALIAS_NODES} values in all "
                                     f"(*{event.anchor} alone for {size}) — write the values out")
            return super().compose_node(parent, index)
        self._depth += 1
        self._nodes += 1
        if self._depth > MAX_DEPTH:
            raise _Refused(self.peek_event().start_mark.line + 1,
                           f"nested more than {MAX_DEPTH} levels deep — flatten it")
        if self._nodes > self._max_nodes:
            raise _Refused(self.peek_event().start_mark.line + 1,
                           f"more than {self._max_nodes} values in one file — this is not a config file")
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, SequenceNode):
            children = node.value
        else:
            children = []
        self._sizes[id(node)] = 1 + sum(self._sizes.get(id(c), 1) for c in children)
        return node


class _PyLoader(_BoundedComposer, yaml.SafeLoader):
    def __init__(self, text: str, max_nodes: int):
        yaml.SafeLoader.__init__(self, text)
        self._bound(max_nodes)


if _CParser is not None:
    class _CLoader(_BoundedComposer, _CParser, SafeConstructor, Resolver):  # type: ignore[misc, valid-type]
        def __init__(self, data: bytes, max_nodes: int):
            _CParser.__init__(self, data)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)
            Composer.__init__(self)
            self._bound(max_nodes)


def _loader(text: str, max_nodes: int, pure: bool = False) -> tuple[_BoundedComposer, str | bytes]:
    """A bounded loader for `text`, and what its error positions index (bytes for libyaml);
    `pure`: PyYAML's own Python parser even where libyaml is there."""
    if _CParser is not None and not pure:
        data = text.encode("utf-8", "surrogatepass")  # a lone surrogate: libyaml's reader refuses it
        return _CLoader(data, max_nodes), data
    return _PyLoader(text, max_nodes), text


def read_file(path: Path, ctx: NodeContext, max_bytes: int = MAX_BYTES, max_nodes: int = MAX_NODES) -> Node | None:
    """The node tree of a YAML file (None: no document); the caller decides what a missing file means,
        any other unreadable or irregular file is one line."""
    try:
        if not path.is_file():
            what = "a folder" if path.is_dir() else "not a regular file"
            raise ctx.fail_at(1, None, f"is {what} — it must be a YAML file")
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise ctx.fail_at(1, None, f"cannot read it ({exc.strerror or exc}) — fix its permissions")
    if len(data) > max_bytes:
        raise ctx.fail_at(1, None, f"larger than {max_bytes // (1024 * 1024)} MiB — this is not a config file")
    return compose(data, ctx, max_nodes)


def compose(data: str | bytes, ctx: NodeContext, max_nodes: int = MAX_NODES) -> Node | None:
    """Compose one YAML document, bounded (see the module's text). Raises ctx.error (one line)."""
    if isinstance(data, bytes):
        data = data[3:] if data.startswith(b"\xef\xbb\xbf") else data  # a UTF-8 byte-order mark
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            raise ctx.fail_at(line, None, f"not UTF-8 text (byte 0x{data[exc.start]:02x}) — save the file as UTF-8")
    else:
        text = data
    loader: _BoundedComposer | None = None
    indexed: str | bytes = text
    try:
        loader, indexed = _loader(text, max_nodes)  # a reader may refuse forbidden characters (NUL…) at once
        node = loader.get_single_node()
    except _Refused as exc:
        raise ctx.fail_at(exc.line, None, exc.problem)
    except yaml.MarkedYAMLError as exc:
        _refuse_in_our_words(text, max_nodes, ctx, loader)
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "unreadable"
        raise ctx.fail_at(mark.line + 1 if mark else 1, None, f"not valid YAML: {problem} — fix the syntax")
    except yaml.reader.ReaderError as exc:
        pos = exc.position if isinstance(exc.position, int) else 0
        line = indexed[:pos].count(b"\n" if isinstance(indexed, bytes) else "\n") + 1
        raise ctx.fail_at(line, None, f"not valid YAML: character #x{exc.character:04x} is not allowed "
                                      "— remove it")
    except yaml.YAMLError as exc:
        _refuse_in_our_words(text, max_nodes, ctx, loader)
        raise ctx.fail_at(1, None, f"not valid YAML: {str(exc).splitlines()[0] if str(exc) else 'unreadable'} "
                                   "— fix the syntax")
    except RecursionError:
        raise ctx.fail_at(1, None, "nested too deeply — flatten it")
    finally:
        if loader is not None:
            loader.dispose()  # type: ignore[attr-defined]
    if node is not None:
        _check_tree(node, ctx)
    return node


def _refuse_in_our_words(text: str, max_nodes: int, ctx: NodeContext, failed: _BoundedComposer | None) -> None:
    """libyaml refused `text`: raise the lab's own refusal if it has one (too deep, too many values,
        aliases).  libyaml's scanner reads ahead and meets its own nesting limit before the composer
        counts the lab's, so the text is read again with PyYAML's Python parser, which has no such
        limit; nothing raised when it finds no bound broken (the caller reports libyaml's problem).
        Only on this error path."""
    if failed is None or isinstance(failed, _PyLoader):
        return
    loader, _ = _loader(text, max_nodes, pure=True)
    try:
        loader.get_single_node()
    except _Refused as exc:
        raise ctx.fail_at(exc.line, None, exc.problem) from None
    except (yaml.YAMLError, RecursionError):
        pass
    finally:
        loader.dispose()  # type: ignore[attr-defined]


def _check_tree(root: Node, ctx: NodeContext) -> None:
    """Every node has a plain tag, every mapping key is a plain value, every scalar can be built."""
    seen: set[int] = set()
    stack: list[tuple[Node, str]] = [(root, TOP)]
    while stack:
        node, key = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, MappingNode):
            if node.tag != MAP_TAG:
                raise ctx.fail(node, key, f"tag {node.tag!r} is not supported — remove it")
            todo = []
            for k, v in node.value:
                if not isinstance(k, ScalarNode):
                    raise ctx.fail(k, key, "a mapping key must be a plain name, not a list or mapping — rename it")
                if is_empty(k):
                    raise ctx.fail(k, key, "an empty key — name it")
                if k.tag == _T + "merge":
                    raise ctx.fail(k, key, "merge keys (<<) are not supported — write the keys out")
                name = str(_build(k, ctx, key))
                todo.append((v, name if key == TOP else f"{key}.{name}"))
            stack.extend(reversed(todo))
        elif isinstance(node, SequenceNode):
            if node.tag != SEQ_TAG:
                raise ctx.fail(node, key, f"tag {node.tag!r} is not supported — remove it")
            stack.extend((item, key) for item in reversed(node.value))
        else:
            _build(node, ctx, key)


def _build(node: Node, ctx: NodeContext, key: str) -> Any:
    if node.tag not in SCALAR_TAGS:
        raise ctx.fail(node, key, f"tag {node.tag!r} is not supported — write a plain value")
    what = SCALAR_TAGS[node.tag]
    if what == "int":
        digits = sum(c.isdigit() for c in node.value)
        if digits > 1000:
            raise ctx.fail(node, key, f"an integer of {digits} digits — write a smaller number")
    try:
        return SafeConstructor().construct_object(node)
    except ValueError as exc:
        detail = f" ({one_line(str(exc), 100)})" if what == "timestamp" else ""
        raise ctx.fail(node, key, f"not a valid {_WHAT[what]}{detail} — fix the value")
    except (yaml.YAMLError, KeyError, AttributeError, TypeError, OverflowError, IndexError):
        raise ctx.fail(node, key, f"not a valid {_WHAT[what]} — fix the value")


# ---------------------------------------------------------------------------------------
# Reading a composed tree.


def scalar(node: Node | None) -> Any:
    """A node's value as YAML's safe loader types it (None for no node)."""
    if node is None:
        return None
    if isinstance(node, ScalarNode):
        return SafeConstructor().construct_object(node)
    return SafeConstructor().construct_document(node)


def is_empty(node: Node | None) -> bool:
    """True for a missing node or an empty value (`key:` with nothing after it, `~`, `null`)."""
    return node is None or (isinstance(node, ScalarNode) and node.tag == _T + "null")


def kind(node: Node) -> str:
    """What a node holds, for messages: 'a mapping', 'a list', 'nothing', or `int 3`."""
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    if is_empty(node):
        return "nothing (an empty value)"
    value = scalar(node)
    return f"{type(value).__name__} {one_line(repr(value), 80)}"


def line_of(node: Node | None, keys: tuple) -> int:
    """The line of the value at `keys` (as deep as it exists), for a message."""
    line = node.start_mark.line + 1 if node is not None else 1
    for k in keys:
        if not isinstance(node, MappingNode):
            break
        for knode, vnode in node.value:
            if knode.value == str(k):
                line = knode.start_mark.line + 1
                node = vnode
                break
        else:
            break
    return line


def duplicate_key(root: Node) -> tuple[int, str, int] | None:
    """The first key held twice by one mapping at any level: (its line, the dotted key, the first
        one's line), keys compared as text; None when there is none."""
    stack: list[tuple[Node, str]] = [(root, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, SequenceNode):
            stack.extend((item, where) for item in node.value)
            continue
        if not isinstance(node, MappingNode):
            continue
        seen: dict[str, int] = {}
        for knode, vnode in node.value:
            name = knode.value if knode.tag == _T + "str" else str(scalar(knode))
            key = f"{where}.{name}" if where else name
            line = knode.start_mark.line + 1
            if name in seen:
                return line, key, seen[name]
            seen[name] = line
            stack.append((vnode, key))
    return None


def fast_loader() -> type:
    """PyYAML's safe loader, libyaml's when built with it (for a file the lab wrote itself)."""
    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def anchor_line(text: str) -> int | None:
    """The line of the first YAML anchor or alias in `text`, or None (refusing them rules out
        amplification bombs)."""
    if "&" not in text and "*" not in text:
        return None
    try:
        for tok in yaml.scan(text, Loader=fast_loader()):
            if isinstance(tok, (yaml.AnchorToken, yaml.AliasToken)):
                return tok.start_mark.line + 1
    except yaml.YAMLError:
        return None  # the parse reports it
    return None


def mapping(ctx: NodeContext, node: Node, key: str) -> list[tuple[Node, Node]]:
    """The (key node, value node) pairs of a mapping; refuses other kinds and duplicate keys."""
    if not isinstance(node, MappingNode):
        hint = ctx.mapping_hint or " — give `name: value` pairs under it"
        raise ctx.fail(node, key, f"expected a mapping, got {kind(node)}{hint}")
    seen: set[str] = set()
    for k, _ in node.value:
        name = str(scalar(k))
        if name in seen:
            raise ctx.fail(k, name if key == TOP else f"{key}.{name}", "duplicate key — keep one")
        seen.add(name)
    return node.value
