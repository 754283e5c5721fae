"""A toolfleet worker in Python serving one tool, `text.stats`, with the Python SDK
(sdk/python). Run: pip install -r requirements.txt && python3 worker.py"""

import re

from toolfleet_worker import Output, serve, tool

TEXT = {"type": "object", "properties": {"text": {"type": "string"}},
        "required": ["text"], "additionalProperties": False}


@tool("text.stats", input_schema=TEXT, waiting_hint="counting the words", timeout_ms=2000,
      idempotent=3)
async def text_stats(args, ctx):
    """Counts the words, sentences and characters of a text"""
    text = args["text"]
    words = len(text.split())
    sentences = len([s for s in re.split(r"[.!?]+", text) if s.strip()])
    noun = "word" if words == 1 else "words"
    return Output({"words": words, "sentences": sentences, "characters": len(text)},
                  summary=f"That text has {words} {noun}.")


if __name__ == "__main__":
    serve(text_stats)
