"""The structured-output constraints (one of each kind) and a prompt for each."""

from __future__ import annotations

from zllm.sampling_params import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
CODE = r"[A-Z]{3}-\d{4}"
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=PERSON),
    "regex": StructuredOutputsParams(regex=CODE),
    "choice": StructuredOutputsParams(choice=["red", "green", "blue"]),
    "grammar": StructuredOutputsParams(grammar='root ::= "(" [0-9]+ (" + " [0-9]+)* ")"'),
    "json_object": StructuredOutputsParams(json_object=True),
}
PROMPTS = {
    "json": "Describe a person as JSON:",
    "regex": "My order code is",
    "choice": "The colour of the sky is",
    "grammar": "An addition:",
    "json_object": "A JSON object about a cat:",
}
# Text to train a small sub-word tokenizer on (helpers/models.py's train_subword_tokenizer), for
# grammars where no real tokenizer is at hand (the GPU machines have none): the prompts and text of
# the kind each grammar allows, so merges span JSON punctuation, words and digits as real ones do.
SUBWORD_CORPUS = [
    *PROMPTS.values(),
    '{"name": "Ada", "age": 36, "city": "Paris"}',
    '{"name": "Bruno", "age": 7, "city": "Rome"}',
    '{"name": "Olga Nilsen", "age": 101, "city": "Oslo"}',
    '{"kind": "cat", "colour": "grey", "lives": 9, "indoor": true, "toys": ["ball", "mouse"]}',
    "My order code is ABC-1234, yours is XYZ-9876 and hers QRS-5050.",
    "The colour of the sky is blue; the grass is green and the rose is red.",
    "An addition: (12 + 30 + 7) and another: (100 + 250).",
    "Once upon a time, a river ran through a valley where farmers grew barley and apples.",
    "Describe the weather in the city today: sunny, cold, windy, with a little rain at night.",
]
