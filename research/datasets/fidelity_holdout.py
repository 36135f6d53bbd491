"""A second held-out multi-document QA set, built unlike every other set in the repository.

Issue 41 asks for fidelity judged on data nothing was tuned on. `multidoc_other.jsonl` already is such a set, but
it, like the bundled synthetic sets, is prose about one named thing a document. This set changes what the
documents look like, not only what they are about:

* six record kinds none of the other sets has (rail timetables, studies of invented drugs, guest-house phone
  bookings, weather-station logs, auction lots, board games), each written in three styles: table-like lines,
  dated notes, dialogue, lists, catalogue entries, questions and answers, prose;
* look-alike distractors: documents of the same kind whose names differ by a letter, a digit or one word
  (service 2K41 / 2K14, the Larkspur Inn / the Larkspar Inn) and whose values differ, so the answer depends on
  reading the right document; the rest of an item is records of other kinds;
* three question types: `single` (one fact of one record), `compare` (which of two look-alikes has the larger,
  smaller or earlier value: both documents must be read), `bridge` (a memo names the record by a nickname and
  the question uses the nickname: the memo and the record must be read);
* 4 to 8 documents an item, 60 to 350 tokens a document and 700 to 2,000 tokens a prompt (SmolLM2's
  tokenizer, with the chat template); documents end with '.', '!', '?', ':', a quote or a bracket, and some
  begin with a digit, a quote or a dash, because the tokenizer's seams at document edges matter to the product.

Answers are short exact strings (a time, a date, a number, a name) found in the answer's document; the asked
fact's values in look-alike documents are different and none contains another, so containment scoring cannot
credit a distractor's value.

    .venv/bin/python research/datasets/fidelity_holdout.py --out research/data/fidelity_holdout.jsonl
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "research" / "data" / "fidelity_holdout.jsonl"
N_ITEMS = 96
SEED = 4127
MIN_DOCS, MAX_DOCS = 4, 8
DOC_TOKENS = (60, 350)
# The user message (documents, "Question: ...") in tokens; the system text and the chat template add ~40 more,
# so the whole prompt stays within 700-2,000.
USER_TOKENS = (680, 1950)
QTYPES = ("single", "single", "compare", "bridge")  # two single questions for each two-document one
LAYOUTS = ("alike", "mixed")  # every other document a look-alike, or one to three look-alikes among others

SYSTEMS = (
    "Several of these records look alike. Read them carefully and answer with the exact value only.",
    "Below are records of different kinds. Reply with just what the question asks for, as written there.",
    "Find the answer in the records and copy it exactly. No explanation is needed.",
    "Answer in as few words as you can, using only the records provided.",
)
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")


# ---------------------------------------------------------------------------------------------------
# Values, and the per-item registry that keeps look-alike values apart


@dataclass(frozen=True)
class Value:
    text: str  # as written in the document
    answer: str  # as accepted in a reply (a number without its unit)
    sort: float  # for comparison questions


class Redraw(Exception):
    """The item's random draws could not meet a constraint; draw the item again."""


class Registry:
    """Strings of one item, by bucket; within a bucket none contains another (case-insensitive), so a reply
    quoting a look-alike's value or name never contains the right one."""

    def __init__(self) -> None:
        self.buckets: dict[str, list[str]] = {}

    def take(self, bucket: str, text: str) -> bool:
        seen, t = self.buckets.setdefault(bucket, []), text.casefold()
        if any(t in s or s in t for s in seen):
            return False
        seen.append(t)
        return True

    def draw(self, rng: random.Random, bucket: str, make: Callable[[random.Random], Value]) -> Value:
        for _ in range(200):
            value = make(rng)
            if self.take(bucket, value.answer):
                return value
        raise Redraw


def _int(lo: int, hi: int, step: int = 1) -> Callable[[random.Random], Value]:
    # No thousands separator: a reply of "1450" must match the document's figure as written.
    def make(rng: random.Random) -> Value:
        n = rng.randrange(lo, hi + 1, step)
        return Value(str(n), str(n), n)
    return make


def _dec(lo: float, hi: float, places: int = 1) -> Callable[[random.Random], Value]:
    # Money has two places and moves in fives (14.65); readings have one (14.2).
    def make(rng: random.Random) -> Value:
        scale, step = 10**places, 5 if places == 2 else 1
        x = rng.randrange(round(lo * scale), round(hi * scale) + 1, step) / scale
        return Value(f"{x:.{places}f}", f"{x:.{places}f}", x)
    return make


def _clock(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def _time(lo_h: int, hi_h: int) -> Callable[[random.Random], Value]:
    def make(rng: random.Random) -> Value:
        m = rng.randrange(lo_h * 60, hi_h * 60)
        return Value(_clock(m), _clock(m), m)
    return make


def _date(years: tuple[int, int], iso: bool, with_year: bool = True) -> Callable[[random.Random], Value]:
    def make(rng: random.Random) -> Value:
        y, mo, d = rng.randint(*years), rng.randint(1, 12), rng.randint(1, 28)
        words = f"{d} {MONTHS[mo - 1]}" + (f" {y}" if with_year else "")
        text = f"{y}-{mo:02d}-{d:02d}" if iso else words
        return Value(text, text, y * 400 + mo * 31 + d)
    return make


def _respell(word: str) -> list[str]:
    """Spellings one letter away: an inner vowel changed, or the last consonant."""
    out = [word[:i] + v + word[i + 1:] for i in range(1, len(word) - 1) if word[i] in "aeiou" for v in "aeiou"]
    if word[-1] not in "aeiou":
        out += [word[:-1] + c for c in "dlnrst" if c != word[-2]]  # not "Fernn"
    return [w for w in out if w != word]


def _recode(code: str) -> list[str]:
    """Codes one keystroke away: two neighbouring digits swapped, or one digit changed."""
    out = []
    for i in range(len(code) - 1):
        if code[i].isdigit() and code[i + 1].isdigit():
            out.append(code[:i] + code[i + 1] + code[i] + code[i + 2:])
    for i, ch in enumerate(code):
        if ch.isdigit():
            out += [code[:i] + d + code[i + 1:] for d in "123456789"]
    return [c for c in out if c != code]


# ---------------------------------------------------------------------------------------------------
# Kinds of record


@dataclass(frozen=True)
class Fact:
    key: str
    bucket: str
    ask: str  # the question, about "{ref}"
    compare: str | None = None  # "Which ..., {a} or {b}?"; answered with the name of ...
    larger_wins: bool = True  # ... the record with the larger (or else the smaller) value


@dataclass
class Entity:
    kind: Kind
    name: str
    style: str
    shared: dict[str, str]  # what look-alikes have in common (a route, a week)
    values: dict[str, Value] = field(default_factory=dict)
    extra: dict[str, str] = field(default_factory=dict)  # more values, never asked

    @property
    def ref(self) -> str:
        return self.kind.ref.format(name=self.name)


@dataclass(frozen=True)
class Kind:
    key: str
    ref: str  # how a question names a record: "service {name}"
    styles: tuple[str, ...]
    new_name: Callable[[random.Random], str]
    look_alikes: Callable[[str], list[str]]  # names one step from a name
    context: Callable[[random.Random], dict[str, str]]
    draw: Callable[[random.Random, Registry, Entity], None]  # fills values and extra
    render: Callable[[random.Random, Entity, list[str]], str]  # the document, with these filler lines
    facts: tuple[Fact, ...]
    fillers: tuple[str, ...]
    aliases: tuple[str, ...]  # nicknames a memo gives a record


def _pair_lines(pairs: Sequence[tuple[str, str]], q: str, a: str) -> list[str]:
    return [f"{q}{x}\n{a}{y}" for x, y in pairs]


# Rail timetables: table-like lines, a notice, or a line that opens with the departure time.

_STATIONS = ("Brackwater", "Ellesmoor", "Pitchcombe", "Sorrel Green", "Hawkmere", "Tillinghast", "Crossbeck",
             "Wendlebury", "Mallow Cross", "Oxendale", "Foxhollow", "Ribblestead", "Yewbarrow", "Quarrendon")


def _rail_context(rng: random.Random) -> dict[str, str]:
    origin, stop1, stop2, terminus = rng.sample(_STATIONS, 4)
    return {"origin": origin, "stop1": stop1, "stop2": stop2, "terminus": terminus}


def _rail_draw(rng: random.Random, reg: Registry, ent: Entity) -> None:
    dep, minutes = reg.draw(rng, "time", _time(5, 19)), rng.randint(50, 180)  # in by 22:00
    arr = Value(_clock(int(dep.sort) + minutes), _clock(int(dep.sort) + minutes), dep.sort + minutes)
    # The calling points' times join the registry too: no asked time may hide in a look-alike's table.
    ent.extra.update(stop1=_clock(int(dep.sort + 0.3 * minutes)), stop2=_clock(int(dep.sort + 0.7 * minutes)))
    if not all(reg.take("time", t) for t in (arr.answer, ent.extra["stop1"], ent.extra["stop2"])):
        raise Redraw
    ent.values.update(dep=dep, arr=arr, platform=reg.draw(rng, "platform", _int(1, 18)),
                      coaches=reg.draw(rng, "coaches", _int(3, 12)),
                      fare=reg.draw(rng, "money", _dec(4, 48.9, places=2)))


def _rail_render(rng: random.Random, e: Entity, fillers: list[str]) -> str:
    s, v, x = e.shared, {k: val.text for k, val in e.values.items()}, e.extra
    if e.style == "table":
        lines = [f"Service {e.name} | {s['origin']} to {s['terminus']}",
                 f"{s['origin']:<14} dep {v['dep']}   platform {v['platform']}",
                 f"{s['stop1']:<14} dep {x['stop1']}",
                 f"{s['stop2']:<14} dep {x['stop2']}",
                 f"{s['terminus']:<14} arr {v['arr']}",
                 f"Coaches: {v['coaches']} | Standard single: {v['fare']}"]
        return "\n".join(lines + ([] if not fillers else ["Notes:"] + [f"- {f}" for f in fillers]))
    if e.style == "notice":
        head = (f"Timetable notice. Service {e.name} now leaves {s['origin']} at {v['dep']} from platform "
                f"{v['platform']}, calling at {s['stop1']} and {s['stop2']} before it reaches {s['terminus']} at "
                f"{v['arr']}.")
        tail = f"It runs with {v['coaches']} coaches, and a standard single ticket costs {v['fare']}."
        cut = rng.randint(0, len(fillers))
        return " ".join([head, *fillers[:cut], tail, *fillers[cut:]])
    head = (f"{v['dep']} from {s['origin']} (platform {v['platform']}): service {e.name} to {s['terminus']}, "
            f"due in at {v['arr']}.")
    body = (f"Calls at {s['stop1']} ({x['stop1']}) and {s['stop2']} ({x['stop2']}). "
            f"Formed of {v['coaches']} coaches. Single fare {v['fare']}.")
    return "\n".join([head, body, *fillers])


RAIL = Kind(
    key="rail", ref="service {name}", styles=("table", "notice", "timefirst"),
    new_name=lambda rng: f"{rng.randint(1, 9)}{rng.choice('BCFHKLMPRT')}{rng.randint(10, 99)}",
    look_alikes=_recode, context=_rail_context, draw=_rail_draw, render=_rail_render,
    facts=(
        Fact("dep", "time", "At what time does {ref} leave {origin}?",
             "Which leaves {origin} earlier, {a} or {b}?", larger_wins=False),
        Fact("arr", "time", "At what time is {ref} due at {terminus}?",
             "Which gets to {terminus} later, {a} or {b}?"),
        Fact("platform", "platform", "From which platform does {ref} leave {origin}?"),
        Fact("coaches", "coaches", "How many coaches does {ref} have?", "Which train is longer, {a} or {b}?"),
        Fact("fare", "money", "What does a standard single ticket on {ref} cost?",
             "Which has the cheaper standard single fare, {a} or {b}?", larger_wins=False),
    ),
    fillers=(
        "Bicycles travel free but must be booked at the ticket office.",
        "The trolley serves hot drinks as far as the junction.",
        "The rear carriage is a quiet coach; please keep phone calls short.",
        "Groups of walkers may reserve seats in the front coach.",
        "Passengers for the branch line change at the junction and wait on the opposite side.",
        "During the harvest the train may wait a few minutes for connecting buses.",
        "Dogs on leads are welcome, though not on the seats.",
        "Tickets bought on board cost more than those bought at a station.",
        "There is step-free access everywhere except the halt by the quarry.",
        "The guard announces each stop while the platform signs are being repainted.",
        "Luggage racks fill quickly on market days, so travel light if you can.",
        "When the river floods, a bus replaces the train between the two bridges.",
        "Is the waiting room open early? Only on weekdays, when the porter is on duty.",
        "Please keep the doors clear while the train stands in the station!",
        "Changes to this timetable will be listed here:",
        "(Times may differ on public holidays.)",
        "Why not break the journey at the junction and look round the market?",
    ),
    aliases=("the market train", "the school train", "the hikers' train", "the early post train",
             "the fair train", "the shoppers' train"),
)


# Studies of invented drugs: dated notes, a plain summary, or a list of key figures.

_CONDITIONS = ("chronic cough", "seasonal hay fever", "mild asthma", "night-time heartburn", "restless legs",
               "joint stiffness", "ringing in the ears", "dry eyes", "hand eczema")
_SYLLABLES = (("vel", "tor", "mar", "qui", "sul", "dra", "ben", "far", "lox", "pim", "cal", "nor"),
              ("na", "ri", "va", "lo", "de", "mi", "te", "so"),
              ("trine", "zolid", "pamil", "fexin", "dorane", "vestin", "lurex", "quinate"))


def _trial_context(rng: random.Random) -> dict[str, str]:
    drug = "".join(rng.choice(part) for part in _SYLLABLES)
    return {"condition": rng.choice(_CONDITIONS), "drug": drug}


def _trial_draw(rng: random.Random, reg: Registry, ent: Entity) -> None:
    # Look-alike studies test look-alike drugs: velnatrine, velnotrine...
    drugs = [ent.shared["drug"]] + _respell(ent.shared["drug"])
    ent.extra["drug"] = next((d for d in drugs if reg.take("drug", d)), "")
    if not ent.extra["drug"]:
        raise Redraw
    iso = ent.style == "notes"
    ent.values.update(start=reg.draw(rng, "date", _date((2026, 2034), iso)),
                      enrolled=reg.draw(rng, "count", _int(48, 960)),
                      dose=reg.draw(rng, "dose", _int(5, 400, 5)),
                      sites=reg.draw(rng, "sites", _int(2, 40)),
                      response=reg.draw(rng, "percent", _int(8, 79)))
    ent.extra["review"] = reg.draw(rng, "date", _date((2026, 2034), iso)).text


def _trial_render(rng: random.Random, e: Entity, fillers: list[str]) -> str:
    v, drug, cond = {k: val.text for k, val in e.values.items()}, e.extra["drug"], e.shared["condition"]
    if e.style == "notes":
        lines = [f"Study {e.name}: {drug} for {cond}",
                 f"{v['start']}  first participant enrolled",
                 f"{e.extra['review']}  safety review held",
                 f"Enrolled: {v['enrolled']}. Sites: {v['sites']}. Dose: {v['dose']} mg a day.",
                 f"Responders at the final visit: {v['response']}%"]
        return "\n".join(lines + [f"Note: {f}" for f in fillers])
    if e.style == "summary":
        facts = [f"Study {e.name} tested {drug} in adults with {cond}.",
                 f"The first participant was enrolled on {v['start']}.",
                 f"In all, {v['enrolled']} people took part at {v['sites']} sites, each taking {v['dose']} mg a day.",
                 f"By the final visit {v['response']} per cent had responded."]
        cut = rng.randint(1, len(fillers)) if fillers else 0
        return " ".join(facts[:2] + fillers[:cut] + facts[2:] + fillers[cut:])
    lines = [f"- Study: {e.name}", f"- Drug: {drug}", f"- Condition: {cond}", f"- First enrolment: {v['start']}",
             f"- Participants: {v['enrolled']}", f"- Sites: {v['sites']}", f"- Daily dose: {v['dose']} mg",
             f"- Responders: {v['response']}%"]
    return "\n".join(lines + ([] if not fillers else ["", " ".join(fillers)]))


TRIAL = Kind(
    key="trial", ref="study {name}", styles=("notes", "summary", "figures"),
    new_name=lambda rng: f"{rng.choice(('VX', 'TR', 'KL', 'MZ', 'OB', 'RD', 'SN', 'PQ'))}-{rng.randint(1000, 9999)}",
    look_alikes=_recode, context=_trial_context, draw=_trial_draw, render=_trial_render,
    facts=(
        Fact("start", "date", "On what date was the first participant enrolled in {ref}?",
             "Which enrolled its first participant earlier, {a} or {b}?", larger_wins=False),
        Fact("enrolled", "count", "How many participants did {ref} enrol?",
             "Which enrolled more participants, {a} or {b}?"),
        Fact("dose", "dose", "What daily dose, in mg, was given in {ref}?",
             "Which gave the lower daily dose, {a} or {b}?", larger_wins=False),
        Fact("sites", "sites", "At how many sites did {ref} run?"),
        Fact("response", "percent", "What percentage of participants in {ref} responded?",
             "Which had the higher share of responders, {a} or {b}?"),
    ),
    fillers=(
        "Participants kept a daily diary of their symptoms on paper cards.",
        "Blood samples were taken at every clinic visit and stored frozen.",
        "The most common side effect was a mild headache that passed within a day.",
        "An independent board looked over the safety data at regular intervals.",
        "Neither the participants nor the nurses knew who was given the placebo.",
        "Recruitment was slower than planned during the winter months.",
        "A handful of participants withdrew after moving away from the area.",
        "The tablets were coated to hide their bitter taste.",
        "Results were shown at a regional meeting before the full report appeared.",
        "Did the benefit last after treatment stopped? That is left for a later study.",
        "Clinic visits were booked early in the morning, before breakfast.",
        "A small group also wore a sleep monitor on the wrist.",
        "The protocol was amended once, to widen the age range.",
        "No serious safety concerns were raised!",
        "(The full report is held by the sponsor.)",
        "Open question: would a higher dose have helped more?",
    ),
    aliases=("the study the ethics board queried", "the study in the newsletter", "the study with paper forms",
             "the study moved to the new wing", "the study the nurses call the morning study"),
)


# Guest-house bookings taken by telephone: a script, quoted speech, or the desk's call log.

_INN_WORDS = ("Larkspur", "Tansy", "Whimbrel", "Hobnail", "Feverfew", "Gannet", "Kittiwake", "Bramling", "Plover",
              "Marigold", "Sandpiper", "Rowanberry", "Coltsfoot", "Teasel")
_INN_TYPES = ("Inn", "Lodge", "House", "Arms", "Tavern")

_BOOKING_PAIRS = (
    ("Is there parking?", "There is a small yard behind the kitchen."),
    ("Do you allow dogs?", "Small ones, yes, if they stay off the beds."),
    ("Could we have a quiet room?", "The rooms at the back look over the garden and are very quiet."),
    ("Is there somewhere to dry boots?", "There is a boot room by the side door."),
    ("Do you serve evening meals?", "Only at weekends, and it is best to ask in the morning."),
    ("How far is the station?", "About a quarter of an hour on foot, mostly downhill."),
    ("Can I pay when I arrive?", "Of course, by card or in cash."),
    ("Is the bar open late?", "Until the landlord gets tired, usually!"),
    ("Are there many stairs?", "Quite steep ones, I'm afraid."),
    ("Could you put a cot in the room?", "We have one in the attic; I'll bring it down."),
    ("Is there a shop nearby?", "The village shop shuts at lunchtime on Sundays."),
    ("Do the rooms have a kettle?", "Every room has a kettle and a tin of biscuits."),
    ("Can we arrive late?", "The door is locked at night. Could you be here before dark?"),
)


def _booking_draw(rng: random.Random, reg: Registry, ent: Entity) -> None:
    ent.values.update(arrival=reg.draw(rng, "date", _date((2030, 2030), iso=False, with_year=False)),
                      nights=reg.draw(rng, "nights", _int(2, 14)), room=reg.draw(rng, "room", _int(2, 48)),
                      price=reg.draw(rng, "money", _int(45, 240)), breakfast=reg.draw(rng, "time", _time(6, 9)))


def _booking_render(rng: random.Random, e: Entity, fillers: list[str]) -> str:
    v = {k: val.text for k, val in e.values.items()}
    pairs = [(q, dict(_BOOKING_PAIRS)[q]) for q in fillers]  # the fillers are the pairs' questions
    if e.style == "script":
        first = pairs[: len(pairs) // 2]
        lines = [f"Desk: Good evening, the {e.name}.", f"Caller: Hello. Have you a room from {v['arrival']}?",
                 "Desk: For how many nights?", f"Caller: {v['nights']}, please.",
                 *(["Desk: Let me look at the book. Anything else while I do?"] if first else []),
                 *_pair_lines(first, "Caller: ", "Desk: "),
                 f"Desk: Room {v['room']} is free then. It comes to {v['price']} a night.",
                 "Caller: And breakfast?", f"Desk: From {v['breakfast']}, in the front parlour.",
                 *_pair_lines(pairs[len(pairs) // 2:], "Caller: ", "Desk: ")]
        return "\n".join(lines)
    if e.style == "quoted":
        lines = [f'"The {e.name}, good morning," said the clerk.',
                 f'"I would like a room from {v["arrival"]}, for {v["nights"]} nights," said the caller.',
                 f'"Room {v["room"]} is free. That will be {v["price"]} a night, and breakfast starts at '
                 f'{v["breakfast"]}."']
        lines += [f'"{q}" asked the caller.\n"{a}"' for q, a in pairs]
        return "\n".join(lines)
    lines = [f"-- Call log, the {e.name} --", f"Caller wants a room from {v['arrival']}, {v['nights']} nights.",
             f"Offered room {v['room']} at {v['price']} a night.", f"Breakfast from {v['breakfast']}, told them so."]
    lines += [f"Asked: {q} Told them: {a}" for q, a in pairs]
    return "\n".join(lines)


BOOKING = Kind(
    key="booking", ref="the {name}", styles=("script", "quoted", "log"),
    new_name=lambda rng: f"{rng.choice(_INN_WORDS)} {rng.choice(_INN_TYPES)}",
    look_alikes=lambda name: [f"{w} {name.split()[1]}" for w in _respell(name.split()[0])]
    + [f"{name.split()[0]} {t}" for t in _INN_TYPES if t != name.split()[1]],
    context=lambda rng: {}, draw=_booking_draw, render=_booking_render,
    facts=(
        Fact("arrival", "date", "From what date is the room at {ref} booked?",
             "Which booking starts later, the one at {a} or the one at {b}?"),
        Fact("nights", "nights", "For how many nights is the room at {ref} booked?",
             "Which booking is for more nights, the one at {a} or the one at {b}?"),
        Fact("room", "room", "Which room number was offered at {ref}?"),
        Fact("price", "money", "How much a night did {ref} ask for the room?",
             "Which quoted the lower price a night, {a} or {b}?", larger_wins=False),
        Fact("breakfast", "time", "From what time is breakfast served at {ref}?"),
    ),
    fillers=tuple(q for q, _ in _BOOKING_PAIRS),
    aliases=("the place the choir uses", "the walkers' favourite", "the house with the blue door",
             "the place by the ford", "the inn near the mill"),
)


# Weather-station logs of a few days: a dashed list, a table, or an observer's notes.

_STATION_WORDS = ("Kelloch", "Brannock", "Whistow", "Scarnside", "Dunnock", "Clunemore", "Gorsedale", "Tarnholt",
                  "Widdop", "Haverbrae", "Culvery", "Rookwith")
_STATION_TYPES = ("Moor", "Head", "Fell", "Point", "Edge")


def _weather_context(rng: random.Random) -> dict[str, str]:
    month, first, n = rng.choice(MONTHS), rng.randint(1, 22), rng.randint(3, 5)
    days = [f"{first + j} {month}" for j in range(n)]
    return {"days": "|".join(days), "day": rng.choice(days)}


def _weather_draw(rng: random.Random, reg: Registry, ent: Entity) -> None:
    for day in ent.shared["days"].split("|"):
        high, low = reg.draw(rng, "temp", _dec(9, 31.9)), reg.draw(rng, "temp", _dec(0.5, 8.9))
        rain = reg.draw(rng, "rain", _dec(0.2, 34.9))
        if day == ent.shared["day"]:
            ent.values.update(high=high, low=low, rain=rain)
        else:
            ent.extra[day] = f"{high.text}|{low.text}|{rain.text}"
    ent.values.update(gust=reg.draw(rng, "gust", _int(31, 118)), sun=reg.draw(rng, "sun", _dec(4, 61.9)))


def _weather_render(rng: random.Random, e: Entity, fillers: list[str]) -> str:
    v = {k: val.text for k, val in e.values.items()}
    rows = [(d, *(e.extra[d].split("|") if d in e.extra else (v["high"], v["low"], v["rain"])))
            for d in e.shared["days"].split("|")]
    if e.style == "list":
        lines = [f"-- {e.name} station, daily readings --"]
        lines += [f"- {d}: high {h} °C, low {lo} °C, rain {r} mm" for d, h, lo, r in rows]
        lines += [f"Strongest gust of the week: {v['gust']} km/h.", f"Sunshine for the week: {v['sun']} hours."]
        return "\n".join(lines + fillers)
    if e.style == "table":
        lines = [f"{e.name} station, readings for the week", "Date | High °C | Low °C | Rain mm"]
        lines += [f"{d} | {h} | {lo} | {r}" for d, h, lo, r in rows]
        lines += [f"Gust max {v['gust']} km/h; sunshine {v['sun']} h", *fillers]
        return "\n".join(lines)
    notes = [f"On {d} the thermometer reached {h} °C and fell to {lo} °C overnight, with {r} mm of rain."
             for d, h, lo, r in rows]
    cut = rng.randint(0, len(fillers))
    return "\n".join([f"Observer's notes from {e.name} station.", " ".join(notes + fillers[:cut]),
                      f"The strongest gust was {v['gust']} km/h, and the sun shone for {v['sun']} hours in all.",
                      *([" ".join(fillers[cut:])] if fillers[cut:] else [])])


WEATHER = Kind(
    key="weather", ref="{name} station", styles=("list", "table", "notes"),
    new_name=lambda rng: f"{rng.choice(_STATION_WORDS)} {rng.choice(_STATION_TYPES)}",
    look_alikes=lambda name: [f"{w} {name.rsplit(' ', 1)[1]}" for w in _respell(name.rsplit(" ", 1)[0])]
    + [f"{name.rsplit(' ', 1)[0]} {t}" for t in _STATION_TYPES if t != name.rsplit(" ", 1)[1]],
    context=_weather_context, draw=_weather_draw, render=_weather_render,
    facts=(
        Fact("high", "temp", "What was the highest temperature, in °C, at {ref} on {day}?",
             "Which was warmer on {day}, {a} or {b}?"),
        Fact("low", "temp", "What was the lowest temperature, in °C, at {ref} on {day}?"),
        Fact("rain", "rain", "How much rain, in mm, fell at {ref} on {day}?",
             "Which was wetter on {day}, {a} or {b}?"),
        Fact("gust", "gust", "What was the strongest gust of the week at {ref}, in km/h?",
             "Which had the stronger top gust, {a} or {b}?"),
        Fact("sun", "sun", "How many hours of sunshine did {ref} record over the week?"),
    ),
    fillers=(
        "The rain gauge was emptied each morning before the readings were written down.",
        "Mist lay in the valley until the middle of the morning on most days.",
        "A pair of swifts has nested under the eaves of the instrument hut again.",
        "The wind vane stuck briefly and was freed with a drop of oil.",
        "Volunteers walk up from the village to take the readings.",
        "Frost formed on the grass thermometer on the coldest night.",
        "Was the gust reading trustworthy? The anemometer had been checked the week before.",
        "Hail fell briefly during a thunderstorm but did little damage.",
        "Snow still lay on the high ground to the north.",
        "The screen was repainted white, as peeling paint can warm the thermometers.",
        "Sheep grazing by the enclosure had to be chased off the gauge twice!",
        "The barometer fell sharply the evening before the storm.",
        "(Readings are provisional until checked by the regional office.)",
        "Will the new gauge read the same as the old one?",
    ),
    aliases=("the station the school visits", "the station with the new rain gauge",
             "the station on the pilgrims' path", "the station the ferry crews phone"),
)


# Auction lots: a catalogue entry opening with the lot number, a sale report, or the auctioneer's words.

_MAKERS = ("Ashbury", "Tolliver", "Pemberly", "Garrick", "Hensley", "Marlock", "Bexworth", "Cardew", "Quillfeather",
           "Fellowes", "Darnell", "Wickersham")
_OBJECTS = {
    "longcase clock": "An oak case with a painted dial and brass finials",
    "writing desk": "A walnut desk with a leather top and three small drawers",
    "tea caddy": "A rosewood caddy with two lidded compartments",
    "music box": "A cylinder music box in a fruitwood case",
    "barometer": "A wheel barometer with a silvered dial",
    "sea chest": "A pine chest with rope handles and painted ends",
    "rocking horse": "A carved horse on a trestle stand, with a horsehair mane",
    "spinning wheel": "A beech and oak wheel with its original flyer",
}


def _lot_draw(rng: random.Random, reg: Registry, ent: Entity) -> None:
    hammer = reg.draw(rng, "money", _int(150, 18000, 10))
    lo = round(hammer.sort * rng.uniform(0.5, 0.9), -1)
    hi = round(lo * 1.5, -1)
    if not (reg.take("money", str(int(lo))) and reg.take("money", str(int(hi)))):
        raise Redraw
    ent.extra["estimate"] = f"{int(lo)} to {int(hi)}"
    ent.values.update(hammer=hammer, lot=reg.draw(rng, "lot", _int(1, 320)), year=reg.draw(rng, "year",
                      _int(1741, 1929)), paddle=reg.draw(rng, "paddle", _int(101, 899)),
                      height=reg.draw(rng, "cm", _int(12, 240)))


def _lot_render(rng: random.Random, e: Entity, fillers: list[str]) -> str:
    v, description = {k: val.text for k, val in e.values.items()}, _OBJECTS[e.name.split(" ", 1)[1]]
    if e.style == "catalogue":
        lines = [f"{v['lot']}  {e.name}", f"{description}. Height {v['height']} cm.", f"Made in {v['year']}.",
                 *fillers, f"Estimate {e.extra['estimate']}.",
                 f"Result: sold for {v['hammer']} (paddle {v['paddle']})"]
        return "\n".join(lines)
    if e.style == "report":
        return " ".join([f"At the spring sale the {e.name} (lot {v['lot']}) was knocked down for {v['hammer']} to "
                         f"the bidder holding paddle {v['paddle']}.", *fillers,
                         f"Made in {v['year']} and {v['height']} cm tall, it had been estimated at "
                         f"{e.extra['estimate']}."])
    return "\n".join([f'"Lot {v["lot"]}: the {e.name}, made in {v["year"]}, {v["height"]} centimetres high.',
                      f'{description}. {" ".join(fillers)}'.strip(),
                      f'Estimate {e.extra["estimate"]}. Sold at {v["hammer"]} to paddle {v["paddle"]}!"'])


LOT = Kind(
    key="lot", ref="the {name}", styles=("catalogue", "report", "auctioneer"),
    new_name=lambda rng: f"{rng.choice(_MAKERS)} {rng.choice(list(_OBJECTS))}",
    look_alikes=lambda name: [f"{w} {name.split(' ', 1)[1]}" for w in _respell(name.split()[0])]
    + [f"{name.split()[0]} {o}" for o in _OBJECTS if o != name.split(" ", 1)[1]],
    context=lambda rng: {}, draw=_lot_draw, render=_lot_render,
    facts=(
        Fact("hammer", "money", "What price was {ref} sold for?", "Which sold for more, {a} or {b}?"),
        Fact("lot", "lot", "Under which lot number was {ref} offered?"),
        Fact("year", "year", "In what year was {ref} made?", "Which is older, {a} or {b}?", larger_wins=False),
        Fact("paddle", "paddle", "Which paddle number bought {ref}?"),
        Fact("height", "cm", "How tall is {ref}, in centimetres?", "Which is taller, {a} or {b}?"),
    ),
    fillers=(
        "Minor wear to the edges, as expected with age and use.",
        "It stayed in the same family for several generations.",
        "A small repair to the back panel shows on close inspection.",
        "A buyer's premium is added to the hammer price.",
        "Viewing took place over the two days before the sale.",
        "Bidding on the telephone was brisk all afternoon.",
        "The original key is included.",
        "A paper label underneath gives the maker's name in faded ink.",
        "Buyers must collect within a fortnight of the sale.",
        "Is it genuine? The cataloguer has no doubt, citing the joints and the tool marks.",
        "Several dealers in the room were heard to call it a bargain!",
        "The surface has been waxed but never refinished.",
        "(Condition report on request.)",
        "Who fitted the replacement hinges, and when?",
    ),
    aliases=("the piece the museum wanted", "the cover lot", "the piece restored last winter",
             "the lot withdrawn and re-offered"),
)


# Board games: questions and answers, table-like box text, or a review opening with the title in quotes.

_GAME_FIRST = ("Riddle", "Bramble", "Puzzle", "Tangle", "Beacon", "Meadow", "Ledger", "Thicket", "Carnival",
               "Lantern")
_GAME_SECOND = ("Lanyards", "Kites", "Spindles", "Teacups", "Moths", "Ferns", "Bells", "Sparrows", "Thimbles",
                "Acorns", "Pennants", "Whistles")
_GAME_PAIRS = (
    ("Can it be played alone?", "There is a solo variant at the back of the rule book."),
    ("Are the cards sleeved?", "No, but standard sleeves fit them well."),
    ("Is there much reading?", "Very little; the symbols explain most of the rules."),
    ("Does the box have an insert?", "A cardboard insert keeps the pieces apart."),
    ("Who wins a tie?", "The player who went last in the final round."),
    ("Is it good for families?", "Most families pick it up after one practice round."),
    ("Can players trade cards?", "Only during the market phase, and only face up."),
    ("Is there an expansion?", "One has been promised, but no date is set."),
    ("How loud does it get?", "It is a noisy game once the bluffing starts!"),
    ("Are the rules hard to learn?", "The first round is slow, then everything clicks."),
    ("Does luck matter?", "Some, but good planning usually wins."),
    ("Does it need a big table?", "A kitchen table is plenty."),
    ("Is there a travel edition?", "Not yet. Would you buy one?"),
)


def _game_draw(rng: random.Random, reg: Registry, ent: Entity) -> None:
    ent.values.update(minutes=reg.draw(rng, "minutes", _int(15, 240, 5)), cards=reg.draw(rng, "cards",
                      _int(36, 260)), age=reg.draw(rng, "age", _int(6, 16)), year=reg.draw(rng, "year",
                      _int(1994, 2031)))
    ent.extra["players"] = str(rng.randint(3, 8))


def _game_render(rng: random.Random, e: Entity, fillers: list[str]) -> str:
    v, pairs = {k: val.text for k, val in e.values.items()}, [(q, dict(_GAME_PAIRS)[q]) for q in fillers]
    if e.style == "faq":
        lines = [f"{e.name}: questions we are often asked", "Q: How long does a game take?",
                 f"A: Around {v['minutes']} minutes once everyone knows the rules.",
                 "Q: How many cards are in the box?", f"A: {v['cards']}, and a rule sheet.",
                 *_pair_lines(pairs, "Q: ", "A: "),
                 "Q: What age is it for?", f"A: Players from {v['age']} up.",
                 "Q: When did it first come out?", f"A: In {v['year']}."]
        return "\n".join(lines)
    if e.style == "box":
        lines = [e.name, f"Players: 2 to {e.extra['players']} | Time: {v['minutes']} min | Ages: {v['age']}+",
                 f"Contents: {v['cards']} cards, a board, a rule sheet", f"First published {v['year']}.",
                 *(f"{q} {a}" for q, a in pairs)]
        return "\n".join(lines)
    text = (f'"{e.name}" is a card game for 2 to {e.extra["players"]} players, first published in {v["year"]}. '
            f"A game lasts about {v['minutes']} minutes; the box holds {v['cards']} cards, and the makers suggest it "
            f"for ages {v['age']} and up.")
    return " ".join([text, *(f'"{q}" {a}' for q, a in pairs)])


GAME = Kind(
    key="game", ref="{name}", styles=("faq", "box", "review"),
    new_name=lambda rng: f"{rng.choice(_GAME_FIRST)} of {rng.choice(_GAME_SECOND)}",
    look_alikes=lambda name: [f"{name.split()[0]} of {w}" for w in _respell(name.split()[2])]
    + [f"{w} of {name.split()[2]}" for w in _GAME_FIRST if w != name.split()[0]],
    context=lambda rng: {}, draw=_game_draw, render=_game_render,
    facts=(
        Fact("minutes", "minutes", "How long does a game of {ref} take, in minutes?",
             "Which takes longer to play, {a} or {b}?"),
        Fact("cards", "cards", "How many cards come in the box of {ref}?", "Which has more cards, {a} or {b}?"),
        Fact("age", "age", "From what age is {ref} recommended?"),
        Fact("year", "year", "In what year was {ref} first published?",
             "Which came out first, {a} or {b}?", larger_wins=False),
    ),
    fillers=tuple(q for q, _ in _GAME_PAIRS),
    aliases=("this month's pick", "the club's favourite", "the copy missing its rule book",
             "the copy with the torn box"),
)

KINDS = (RAIL, TRIAL, BOOKING, WEATHER, LOT, GAME)

# Memos: the second document of a bridge question, naming records by nicknames.
_MEMO_HEADS = ("- Note pinned to the office board -", '"Quick reminder," the note begins.', "Memo to all staff.",
               "From the front office, for everyone on the rota:")
_MEMO_FILLERS = (
    "Please pass this on to anyone who missed the meeting.",
    "The old list on the notice board is out of date and will come down.",
    "If anything here looks wrong, leave a note in the tray by the door.",
    "Thanks to everyone who helped sort this out last week!",
    "We will look at the arrangement again at the end of the month.",
    "Nobody should rely on the handwritten list any more.",
    "Who keeps moving the stapler? It lives by the kettle.",
    "Questions go to the office, not to the cleaners:",
    "Has everyone seen the new rota?",
)


def _memo(rng: random.Random, pairs: list[tuple[str, str]], n_fillers: int) -> str:
    said = "; ".join(f"{alias} means {ref}" for alias, ref in pairs)
    fillers = rng.sample(_MEMO_FILLERS, n_fillers)
    return "\n".join([rng.choice(_MEMO_HEADS), f"To avoid mix-ups: {said}.", *fillers])


# ---------------------------------------------------------------------------------------------------
# Items


@dataclass(frozen=True)
class Plan:
    kind: Kind
    fact: Fact
    qtype: str
    layout: str
    k: int
    pos: int  # the answer's document
    system: str


def plans(n: int, seed: int) -> list[Plan]:
    """Kinds, question types, layouts, sizes and system texts balanced over the set, the answer's position spread
    evenly over each size's slots."""
    rng = random.Random(f"fidelity_holdout:{seed}:plan")

    def spread(options: Sequence) -> list:
        out = [options[i % len(options)] for i in range(n)]
        rng.shuffle(out)
        return out

    kinds, qtypes, layouts = spread(KINDS), spread(QTYPES), spread(LAYOUTS)
    sizes, systems = spread(range(MIN_DOCS, MAX_DOCS + 1)), spread(SYSTEMS)
    positions = {k: [p for _ in range(-(-sizes.count(k) // k)) for p in rng.sample(range(k), k)] for k in set(sizes)}
    turn: Counter[str] = Counter()
    out = []
    for i in range(n):
        kind, qtype = kinds[i], qtypes[i]
        facts = [f for f in kind.facts if f.compare] if qtype == "compare" else list(kind.facts)
        fact = facts[turn[kind.key, qtype] % len(facts)]
        turn[kind.key, qtype] += 1
        out.append(Plan(kind, fact, qtype, layouts[i], sizes[i], positions[sizes[i]].pop(0), systems[i]))
    return out


def _entity(rng: random.Random, reg: Registry, kind: Kind, name: str, shared: dict[str, str]) -> Entity:
    ent = Entity(kind, name, rng.choice(kind.styles), shared)
    kind.draw(rng, reg, ent)
    return ent


def _draw(rng: random.Random, plan: Plan) -> tuple[list[Entity | None], Entity, Entity | None, str, list[str], tuple]:
    """The records of an item in order (None for the memo), the answer's record, the other record a two-document
    question reads (None for single questions), the question, the answers and the memo's (nicknames, fillers)."""
    kind, reg = plan.kind, Registry()
    shared = kind.context(rng)
    target_name = kind.new_name(rng)
    reg.take("name", target_name)
    n_records = plan.k - (plan.qtype == "bridge")
    n_alike = n_records - 1 if plan.layout == "alike" else rng.randint(1, min(3, n_records - 1))
    candidates = kind.look_alikes(target_name)
    rng.shuffle(candidates)
    names = [c for c in candidates if reg.take("name", c)][:n_alike]
    if len(names) < n_alike:
        raise Redraw
    target = _entity(rng, reg, kind, target_name, shared)
    alikes = [_entity(rng, reg, kind, name, shared) for name in names]
    others = []
    for _ in range(n_records - 1 - n_alike):
        other = rng.choice([k for k in KINDS if k is not kind])
        name = other.new_name(rng)
        if not reg.take("name", name):
            raise Redraw
        others.append(_entity(rng, reg, other, name, other.context(rng)))

    partner, memo_doc = (alikes[0] if plan.qtype != "single" else None), None
    if plan.qtype == "compare":
        a, b = target.values[plan.fact.key].sort, partner.values[plan.fact.key].sort
        if (b > a) == plan.fact.larger_wins:  # the winner's document holds the answer
            target, partner = partner, target
            alikes[0] = partner
        first, second = rng.sample([target, partner], 2)
        question = plan.fact.compare.format(a=first.ref, b=second.ref, **shared)
        answers = [target.name]
    else:
        ref = target.ref
        if plan.qtype == "bridge":
            alias, alias2 = rng.sample(kind.aliases, 2)
            mapping = [(alias, target.ref), (alias2, partner.ref)]
            rng.shuffle(mapping)
            memo_doc = (mapping, rng.randint(3, 6))
            ref = alias
        question = plan.fact.ask.format(ref=ref, **shared)
        answers = [target.values[plan.fact.key].answer]
    question = question[:1].upper() + question[1:]

    rest: list[Entity | None] = [e for e in alikes + others if e is not target]
    if memo_doc:
        rest.append(None)
    rng.shuffle(rest)
    records = rest[:plan.pos] + [target] + rest[plan.pos:]
    return records, target, partner, question, answers, memo_doc


def _fit(rng: random.Random, ent: Entity, target: int, count: Callable[[str], int]) -> str:
    """The document of `ent` with as many filler lines as bring it nearest `target` tokens within DOC_TOKENS."""
    seed, pool = rng.random(), list(ent.kind.fillers)
    rng.shuffle(pool)
    best, best_gap = None, None
    for n in range(len(pool) + 1):
        text = ent.kind.render(random.Random(seed), ent, pool[:n])
        tokens = count(text)
        if tokens > DOC_TOKENS[1]:
            break
        gap = abs(tokens - target) if tokens >= DOC_TOKENS[0] else None
        if gap is not None and (best_gap is None or gap < best_gap):
            best, best_gap = text, gap
    if best is None:
        raise Redraw
    return best


def make_item(i: int, plan: Plan, seed: int, count: Callable[[str], int]) -> tuple[dict, dict]:
    """The item, and what the tests check it against: each document's record name (None for a memo), the look-alike
    value of the asked fact in each document, the question type and the documents it needs."""
    rng = random.Random(f"fidelity_holdout:{seed}:{i}")
    for _ in range(300):
        try:
            records, target, partner, question, answers, memo = _draw(rng, plan)
        except Redraw:
            continue
        # Documents of 60-350 tokens, drawn around a share of a prompt length that suits the item's size.
        total = rng.randint(max(USER_TOKENS[0] + 40, 70 * plan.k), min(USER_TOKENS[1] - 60, 300 * plan.k))
        weights = [rng.uniform(0.3, 1.7) for _ in records]
        docs = []
        try:
            for rec, w in zip(records, weights, strict=True):
                want = min(max(round(total * w / sum(weights)), DOC_TOKENS[0]), DOC_TOKENS[1])
                docs.append(_fit(rng, rec, want, count) if rec else _memo(rng, *memo))
        except Redraw:
            continue
        user = "\n\n".join(docs) + f"\n\nQuestion: {question}"
        if not USER_TOKENS[0] <= count(user) <= USER_TOKENS[1] or any(count(d) < DOC_TOKENS[0] for d in docs):
            continue
        if not all(a.casefold() in docs[plan.pos].casefold() for a in answers):
            continue
        item = {"id": f"fh{seed}-{i:03d}-{plan.kind.key}-{plan.qtype}-{plan.fact.key}", "system": plan.system,
                "documents": docs, "question": question, "answers": answers, "answer_doc": plan.pos}
        other = partner if plan.qtype == "compare" else None
        needs = [plan.pos] + [j for j, r in enumerate(records) if plan.qtype != "single" and r is other]
        meta = {"qtype": plan.qtype, "target": target.name, "needs": needs,
                "names": [r.name if r else None for r in records],
                "values": [r.values[plan.fact.key].answer if r and r.kind is plan.kind else None for r in records]}
        return item, meta
    raise RuntimeError(f"could not draw item {i}")


def items(n: int = N_ITEMS, seed: int = SEED, count: Callable[[str], int] | None = None) -> list[tuple[dict, dict]]:
    count = count or bundled_counter()
    return [make_item(i, plan, seed, count) for i, plan in enumerate(plans(n, seed))]


def bundled_counter() -> Callable[[str], int]:
    """Token counts with the bundled SmolLM2 tokenizer, which sizes the documents."""
    from transformers import AutoTokenizer

    from kvboost_rag.models import convert_bundled

    tokenizer = AutoTokenizer.from_pretrained(convert_bundled()[0])
    return lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)


# ---------------------------------------------------------------------------------------------------
# Command line


def summarize(path: Path) -> str:
    from transformers import AutoTokenizer

    from kvboost_rag.bench.data import load_items
    from kvboost_rag.models import convert_bundled
    from kvboost_rag.prompts import rag_messages

    tokenizer = AutoTokenizer.from_pretrained(convert_bundled()[0])
    loaded = load_items(path)
    prompt = [len(tokenizer.apply_chat_template(rag_messages(it.documents, it.question, it.system), tokenize=True,
                                                add_generation_prompt=True, return_dict=True)["input_ids"])
              for it in loaded]
    doc = [len(tokenizer(d, add_special_tokens=False).input_ids) for it in loaded for d in it.documents]

    def dist(xs: list[int]) -> str:
        q = statistics.quantiles(xs, n=4)
        return f"min {min(xs)} / q1 {q[0]:.0f} / median {q[1]:.0f} / q3 {q[2]:.0f} / max {max(xs)}"

    ids = [it.id.split("-") for it in loaded]
    return "\n".join([
        f"{path}: {len(loaded)} items",
        f"documents per item: {dict(sorted(Counter(len(it.documents) for it in loaded).items()))}",
        f"tokens per document: {dist(doc)}",
        f"tokens per prompt (chat template, bench layout): {dist(prompt)}",
        f"kinds: {dict(sorted(Counter(x[2] for x in ids).items()))}",
        f"question types: {dict(sorted(Counter(x[3] for x in ids).items()))}",
        f"documents ending with: {dict(Counter(d.rstrip()[-1] for it in loaded for d in it.documents))}",
        f"documents starting with a non-letter: {sum(not d[0].isalpha() for it in loaded for d in it.documents)}",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=N_ITEMS)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    from kvboost_rag.bench.data import write_items

    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_items([item for item, _ in items(args.n, args.seed)], args.out)
    print(summarize(args.out), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
