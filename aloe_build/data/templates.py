"""Mining relation templates from edit requests (:func:`relation_templates`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .requests import EditRequest


def relation_templates(requests: Iterable[EditRequest]) -> dict[str, list[str]]:
    """Mine prompt templates (subject replaced by ``"{}"``) from edit requests, grouped by relation.

    Requests with a ``relation`` (e.g. ``"P101"``) are grouped by it. Without one
    (EasyEdit's CounterFact), templates are linked into relations through each
    record's own data: its rephrases end with another template of the same
    relation filled with the same subject, and its locality prompts are a
    template of the same relation filled with another subject; linked templates
    form one group, keyed by its first template. Requests whose subject does not
    occur in the prompt are skipped; each group lists unique templates in order
    of first appearance. Used to build same-subject prompts of other relations
    (negatives) and of the same relation (paraphrase positives): fill a template
    with ``template.replace("{}", subject)``.
    """
    reqs = [r for r in requests if r.template is not None]
    order = list(dict.fromkeys(r.template for r in reqs))
    if any(r.relation for r in reqs):
        groups: dict[str, list[str]] = {}
        for r in reqs:
            members = groups.setdefault(r.relation or r.template, [])
            if r.template not in members:
                members.append(r.template)
        return groups
    parent = {t: t for t in order}  # union-find over templates
    matcher = _TemplateMatcher(order)
    for r in reqs:
        linked = [matcher.filled(q, r.subject) for q in r.rephrases]
        linked += [matcher.other_subject(loc.prompt) for loc in r.locality]
        for t in linked:
            if t is not None:
                ra, rb = _find(parent, r.template), _find(parent, t)
                parent[rb] = ra
    by_root: dict[str, list[str]] = {}
    for t in order:
        by_root.setdefault(_find(parent, t), []).append(t)
    return {members[0]: members for members in by_root.values()}


def _find(parent: dict[str, str], x: str) -> str:
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


class _TemplateMatcher:
    """Which known template a prompt instantiates (the one with the most fixed text wins)."""

    def __init__(self, templates: Sequence[str]):
        self.templates = sorted(templates, key=lambda t: -len(t.replace("{}", "")))

    def filled(self, prompt: str, subject: str) -> str | None:
        """A template that, filled with ``subject``, ends ``prompt`` (rephrases carry a lead-in sentence)."""
        return next((t for t in self.templates if prompt.endswith(t.replace("{}", subject, 1))), None)

    def other_subject(self, prompt: str) -> str | None:
        """A template that ``prompt`` fills with some single-sentence subject."""
        for t in self.templates:
            head, tail = t.split("{}", 1)
            if len(prompt) > len(head) + len(tail) and prompt.startswith(head) and prompt.endswith(tail):
                middle = prompt[len(head) : len(prompt) - len(tail)]
                if "." not in middle and "?" not in middle:
                    return t
        return None
