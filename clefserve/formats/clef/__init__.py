"""The Clef / clef-flash release format: record encoding, JointSchemaHead, answers, a whole decider."""

from clefserve.formats.clef.answers import answer_question, build_response, probabilities
from clefserve.formats.clef.decider import ClefDecider
from clefserve.formats.clef.encoder import ClefEncoder, render
from clefserve.formats.clef.head import JointSchemaHead, load_head, random_head_tensors, read_head_config
from clefserve.formats.clef.records import QUESTION_TYPES, EncodedQuestion, EncodedRecord

__all__ = [
    "QUESTION_TYPES",
    "ClefDecider",
    "ClefEncoder",
    "EncodedQuestion",
    "EncodedRecord",
    "JointSchemaHead",
    "answer_question",
    "build_response",
    "load_head",
    "probabilities",
    "random_head_tensors",
    "read_head_config",
    "render",
]
