"""The copy workload of `infer bench generate --workload copy`: one chat turn asking the model to
repeat a fixed passage of about 300 tokens with one stated change, the shape of request that
prompt-lookup (n-gram) speculation is for: most output tokens already occur in the prompt.
"""

# Original text for this benchmark; the change asked for is to one word that occurs once.
PASSAGE = (
    "The old lighthouse on the northern cape was built from grey granite quarried a few miles "
    "inland. Its walls are thick at the base and narrow toward the lantern room, where a large "
    "glass lens once turned slowly through the night. For more than a century, a keeper climbed "
    "the spiral stairs every evening to trim the wick, wind the clockwork, and polish the brass "
    "fittings until they shone. The keeper kept a logbook on a small wooden desk beside the "
    "window. Each entry noted the weather, the direction of the wind, the ships that passed, and "
    "the hour at which the light was lit and put out. On calm days the sea below was a pale green, "
    "and seals rested on the flat rocks near the landing. In winter storms, waves struck the cliff "
    "so hard that spray reached the lower windows, and the whole tower seemed to hum. Supplies "
    "arrived by boat once a month: oil for the lamp, flour, tea, candles, and letters from the "
    "mainland. When the light was finally automated, the last keeper left the logbooks to the "
    "village library, where visitors can still read them on Tuesday afternoons. Today a small "
    "electric lamp does the work of the great lens, and the tower is painted white every few "
    "years. Walkers follow the cliff path to the gate, look up at the lantern room, and imagine "
    "the long nights when a single person kept the light burning for sailors they would never meet."
)
CHANGE = ("Tuesday", "Thursday")
MAX_TOKENS = 400


def copy_request_text() -> str:
    """The user turn: the instruction, then the passage."""
    old, new = CHANGE
    return (
        f'Repeat the following passage exactly, word for word, except replace the word "{old}" '
        f'with "{new}". Reply with the passage only.\n\n{PASSAGE}'
    )


def expected_copy() -> str:
    """The passage as a perfect answer would repeat it."""
    return PASSAGE.replace(*CHANGE)
