"""`TextStream`: deltas over random UTF-8 texts cut into random rounds (stop
strings, characters split across tokens) concatenate to the offline text."""
import random

from hybridspec.text.codec import ByteCodec
from hybridspec.text.stream import TextStream
from hybridspec.sampling.stopping import cut_text


def test_deltas_concatenate_to_the_offline_text():
    codec, rng = ByteCodec(), random.Random(0)
    for _ in range(300):
        ids = codec.encode("".join(rng.choice(["a", "é", "日本", " ", "\n", "xy", "🙂"])
                                   for _ in range(rng.randint(1, 30))))
        if rng.random() < 0.3:
            ids = ids[:-1]  # ends inside a character
        stop = rng.choice([(), ("a",), ("日本", "xy")])
        reason = next((s for k in range(1, len(ids) + 1) for s in stop if s in codec.decode(ids[:k])), None)
        if reason is not None:  # the request ends at the token that completes its stop string
            ids = ids[:next(k for k in range(1, len(ids) + 1) if reason in codec.decode(ids[:k]))]
        stream, text, i = TextStream(codec.decode, stop), "", 0
        while i < len(ids):
            k = rng.randint(1, 4)
            text += stream.push(ids[i:i + k], i + k >= len(ids), reason)
            assert cut_text(codec.decode(ids), reason).startswith(text)
            i += k
        assert text == cut_text(codec.decode(ids), reason)


def test_an_incomplete_trailing_character_is_held_back():
    codec, data = ByteCodec(), "héllo wörld ✓".encode()
    stream, deltas = TextStream(codec.decode), []
    for i in range(0, len(data), 3):
        deltas.append(stream.push(list(data[i:i + 3])))
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == "héllo wörld ✓"[:len("".join(deltas))]
    assert "".join(deltas) + stream.push([], True, None) == "héllo wörld ✓"


def test_a_stop_string_is_never_handed_out_before_the_end_is_known():
    """`hybridspec generate` learns that a request ended only after its last tokens
    were pushed (Engine.generate's stream callback): none of the stop string shows."""
    stream = TextStream(ByteCodec().decode, ("<END>",))
    text = "".join(stream.push(list(ch.encode())) for ch in "abc<EN")
    assert text == "ab"  # "c<EN" might still become the stop string
    text += stream.push(list(b"D>"))
    assert text == "abc"
    assert text + stream.push([], True, "<END>") == "abc"
