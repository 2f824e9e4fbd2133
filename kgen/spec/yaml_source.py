"""Read a spec's YAML into plain data plus the line of every field.

PyYAML's loaders forget where values came from and silently keep the last of
duplicate keys, so we compose the node tree ourselves and walk it: each path
(tuple of keys and list indices) maps to the line that wrote it, and problems
the YAML layer can see (duplicate keys, odd keys, unknown tags) are collected
instead of raised, so the caller can report them with everything else. A document
too big or too deep for a spec (an alias bomb) stops the walk with one error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

Loc = tuple[str | int, ...]

_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_MAX_DEPTH = 32  # a real spec nests 4 levels
_MAX_NODES = 10_000  # alias bombs expand exponentially; a real spec has ~100 values


class Unreadable:
    """Placeholder for a value the YAML layer already reported; validation skips it."""

    def __repr__(self) -> str:
        return "<unreadable>"


UNREADABLE = Unreadable()


@dataclass
class YamlProblem:
    loc: Loc
    line: int
    message: str
    blocks: bool = True  # the value at loc is unusable: hide later errors at or under it


@dataclass
class YamlDoc:
    data: object
    root_line: int
    lines: dict[Loc, int] = field(default_factory=dict)
    problems: list[YamlProblem] = field(default_factory=list)


class YamlFileError(Exception):
    """The text is not one readable YAML document of spec size (syntax error, empty file, alias bomb)."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line
        self.message = message


def read_yaml(text: str) -> YamlDoc:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else 1
        msg = f"YAML syntax error: {e.problem or e.context}"
        if e.context and e.problem and e.problem.startswith("but "):  # "expected X" + "but found Y"
            msg = f"YAML syntax error: {e.context} {e.problem}"
        elif e.context and e.problem and e.context_mark:
            msg += f" ({e.context} that starts at line {e.context_mark.line + 1})"
        raise YamlFileError(line, msg) from None
    except yaml.YAMLError as e:
        raise YamlFileError(1, f"YAML error: {e}") from None
    if root is None:
        raise YamlFileError(1, "the file is empty; a spec is a YAML mapping with kgen, name, kind, ...")
    walker = _Walker()
    data = walker.walk(root, (), 0)
    doc = YamlDoc(data, _line(root), walker.lines, walker.problems)
    doc.lines[()] = doc.root_line
    return doc


def _line(node: Node) -> int:
    return node.start_mark.line + 1


class _Walker:
    def __init__(self) -> None:
        self.lines: dict[Loc, int] = {}
        self.problems: list[YamlProblem] = []
        self._ctor = SafeConstructor()
        self._open: set[int] = set()  # ids of nodes being walked, to catch recursive aliases
        self._seen: set[int] = set()  # ids of collections walked once: meeting one again is an alias
        self._alias: Node | None = None  # the outermost alias being expanded
        self._count = 0

    def _problem(self, loc: Loc, line: int, msg: str, blocks: bool = True) -> Unreadable:
        self.problems.append(YamlProblem(loc, line, msg, blocks))
        return UNREADABLE

    def _too_big(self, node: Node, what: str) -> YamlFileError:
        """One error for the whole file (an alias bomb would otherwise be blamed on every field)."""
        if self._alias is not None:
            return YamlFileError(_line(self._alias), f"the YAML {what} through aliases of the anchor on this "
                                                     "line; write the values out (a spec has about a hundred)")
        return YamlFileError(_line(node), f"the YAML {what}; a spec has about a hundred values, 4 levels deep")

    def walk(self, node: Node, loc: Loc, depth: int) -> object:
        self._count += 1
        if self._count > _MAX_NODES:
            raise self._too_big(node, f"expands to more than {_MAX_NODES} values")
        if depth > _MAX_DEPTH:
            raise self._too_big(node, f"nests more than {_MAX_DEPTH} levels deep")
        if id(node) in self._open:
            return self._problem(loc, _line(node), "a YAML alias refers to itself")
        if isinstance(node, ScalarNode):
            return self._scalar(node, loc)
        outer = self._alias
        if self._alias is None and id(node) in self._seen:
            self._alias = node
        self._seen.add(id(node))
        self._open.add(id(node))
        try:
            if isinstance(node, MappingNode) and node.tag == _MAP_TAG:
                return self._mapping(node, loc, depth)
            if isinstance(node, SequenceNode) and node.tag == _SEQ_TAG:
                return [self.walk(item, self._at(loc + (i,), item), depth + 1) for i, item in enumerate(node.value)]
            return self._problem(loc, _line(node), f"unsupported YAML tag {node.tag}")
        finally:
            self._open.discard(id(node))
            self._alias = outer

    def _at(self, loc: Loc, node: Node) -> Loc:
        self.lines[loc] = _line(node)
        return loc

    def _scalar(self, node: ScalarNode, loc: Loc) -> object:
        try:
            return self._ctor.construct_object(node, deep=True)
        except ConstructorError as e:
            return self._problem(loc, _line(node), f"unreadable YAML value: {e.problem}")

    def _mapping(self, node: MappingNode, loc: Loc, depth: int) -> dict[str, object]:
        out: dict[str, object] = {}
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            line = _line(key_node)
            if key_node.tag == _MERGE_TAG:
                self._problem(loc, line, "YAML merge keys (<<) are not supported in specs; write the fields out",
                              blocks=False)
                continue
            key = self._scalar(key_node, loc) if isinstance(key_node, ScalarNode) else None
            if not isinstance(key, str):
                shown = key_node.value if isinstance(key_node, ScalarNode) else "a collection"
                self._problem(loc, line, f"keys must be field names (got {shown!r}; allowed: text keys)",
                              blocks=False)
                continue
            child = loc + (key,)
            if key in first_line:
                # YAML would silently keep only the last value: almost always a copy-paste slip.
                self._problem(child, line, f"duplicate key; line {first_line[key]} already sets it "
                              f"(got {key!r} twice; allowed: each key once)", blocks=False)
            first_line[key] = line
            self.lines[child] = line
            out[key] = self.walk(value_node, child, depth + 1)
        return out
