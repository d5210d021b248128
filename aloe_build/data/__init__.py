"""Edit requests and the loaders of the standard knowledge-editing datasets.

Everything downstream (construction, evaluation, the command line) works on
:class:`EditRequest`; :func:`load_edits` turns a benchmark file into a list of
them, whatever the benchmark's layout. Formats recognised (the name is what
:func:`detect_format` returns and what ends up in ``EditRequest.source``):

================================  ==========================================================
``counterfact_rome``              original ROME CounterFact: ``requested_rewrite{prompt with
                                  "{}", relation_id, subject, target_new{str},
                                  target_true{str}}``, ``paraphrase_prompts``,
                                  ``neighborhood_prompts``, ``attribute_prompts``,
                                  ``generation_prompts``
``counterfact_easyedit``          EasyEdit CounterFact (also EasyEdit's flat ZsRE): ``case_id``,
                                  ``prompt``, ``subject``, ``target_new``, ``ground_truth``,
                                  ``rephrase_prompt``, ``locality_prompt``,
                                  ``locality_ground_truth``
``zsre_mend``                     MEND zsRE: ``subject``, ``src``, ``alt``, ``answers``,
                                  ``rephrase``, ``loc`` ("nq question: ..."), ``loc_ans``
``knowedit_zsre``                 KnowEdit ZsRE: ``subject``, ``prompt``, ``target_new``,
                                  ``ground_truth`` (list), ``rephrase_prompt``,
                                  ``locality{...}``, ``portability{...}``
``knowedit_wikidata_counterfact`` KnowEdit WikiData_counterfact (``train_cf.json``): as above
                                  with a string ``ground_truth`` and no rephrase
``knowedit_wikidata_recent``      KnowEdit WikiData_recent (``recent_train.json``): no
                                  ``ground_truth`` (the fact is new)
``knowedit_wikibio``              KnowEdit WikiBio: ``text``, ``labels``, ``concept``,
                                  ``locality{...}``
``aloe_jsonl``                    our own format, one object per line with the
                                  :class:`EditRequest` field names (see
                                  :func:`save_edits_jsonl`)
================================  ==========================================================

One module per format, as EasyEdit's ``dataset/`` does:

==========================  ==================================================================
:mod:`.requests`            :class:`EditRequest`, :class:`LocalityPrompt`,
                            :class:`PortabilityPrompt`, :class:`EditDataError`,
                            :func:`normalize_answers` (the data classes and their validation)
:mod:`.fields`              helpers shared by the format parsers (required/optional fields,
                            answers, KnowEdit-style prompt groups, error context)
:mod:`.counterfact`         ``counterfact_rome``, ``counterfact_easyedit``
:mod:`.zsre`                ``zsre_mend``
:mod:`.knowedit`            ``knowedit_zsre``, ``knowedit_wikidata_*``, ``knowedit_wikibio``
:mod:`.jsonl`               ``aloe_jsonl``: reading and :func:`save_edits_jsonl`
:mod:`.detect`              :data:`FORMATS`, :func:`detect_format`
:mod:`.load`                reading JSON/JSONL files, :func:`load_edits` (format dispatch)
:mod:`.templates`           :func:`relation_templates`
==========================  ==================================================================

Decisions worth knowing (those about one format are in its module:
:mod:`.counterfact`, :mod:`.zsre`, :mod:`.knowedit`):

* ``prompt`` is always the full request text. ROME templates carry ``"{}"`` for
  the subject; it is substituted at load time.
* ``target_new`` (and every ground truth) is stored stripped, without a leading
  space. Whoever scores a generation target adds the leading space itself
  (``" " + target_new``), as the standard CounterFact/zsRE evaluations do.
* Ground truths arrive as strings, lists, or lists of lists (KnowEdit alias
  lists); they are flattened into one tuple of unique, non-empty strings in
  order of first appearance (``None`` when nothing is left).
* ids: ``str(case_id)`` when the record has one, else ``f"{file stem}-{index}"``
  (index of the record in the file, 0-based). Duplicate ids are an error.
"""

from __future__ import annotations

from .detect import FORMATS, detect_format
from .jsonl import save_edits_jsonl
from .load import load_edits
from .requests import (
    EditDataError,
    EditRequest,
    LocalityPrompt,
    PortabilityPrompt,
    fact_statement,
    normalize_answers,
)
from .requests import PathLike as PathLike  # the path type of load_edits/save_edits_jsonl, not in __all__
from .templates import relation_templates

__all__ = [
    "FORMATS",
    "EditDataError",
    "EditRequest",
    "LocalityPrompt",
    "PortabilityPrompt",
    "detect_format",
    "fact_statement",
    "load_edits",
    "normalize_answers",
    "relation_templates",
    "save_edits_jsonl",
]
