"""Text in and out: the codecs that turn text into token ids and back (codec.py) and the
incremental detokenizer that turns emitted tokens into text deltas (stream.py)."""
