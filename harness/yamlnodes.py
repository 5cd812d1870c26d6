"""Line-aware reading of YAML config files (stages.yaml, targets.yaml, …): the composed node
tree keeps each value's line, so every problem can be one line naming file, line and key."""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode


TOP = "(top level)"  # the key shown for a problem with the document itself


class NodeContext:
    """Which file is being read (as shown in messages), and which error a problem raises."""

    def __init__(self, display: str, error: type[Exception], mapping_hint: str = ""):
        self.display = display
        self.error = error
        self.mapping_hint = mapping_hint

    def fail(self, node: Node | None, key: str, problem: str) -> Exception:
        line = node.start_mark.line + 1 if node is not None else 1
        return self.error(f"{self.display}:{line}: {key}: {problem}")

    def line(self, node: Node) -> str:
        return f"{self.display}:{node.start_mark.line + 1}"


def scalar(node: Node | None) -> Any:
    """A scalar node's value as YAML's safe loader types it."""
    return yaml.safe_load(yaml.serialize(node)) if node is not None else None


def kind(node: Node) -> str:
    """What a node holds, for messages: 'a mapping', 'a list', or `int 3`."""
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    value = scalar(node)
    return f"{type(value).__name__} {value!r}"


def mapping(ctx: NodeContext, node: Node, key: str) -> list[tuple[Node, Node]]:
    """The (key node, value node) pairs of a mapping; refuses other kinds and duplicate keys."""
    if not isinstance(node, MappingNode):
        raise ctx.fail(node, key, f"expected a mapping, got {kind(node)}{ctx.mapping_hint}")
    seen: set[str] = set()
    for k, _ in node.value:
        name = str(scalar(k))
        if name in seen:
            raise ctx.fail(k, name if key == TOP else f"{key}.{name}", "duplicate key — keep one")
        seen.add(name)
    return node.value
