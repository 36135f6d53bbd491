"""The bundled synthetic QA sets' generator: questions about invented entities.

One document of an item holds the answer; the others are look-alikes (same kind of entity, similar
names, different values for the same facts), so a cache that blurs documents together picks the wrong
value. Exact answers make accuracy measurable. Items are in the bench's JSONL format
(`kvboost_rag.bench.data`); `research/datasets/shipped.py` rebuilds the bundled files
`kvboost_rag/bench/synthetic_k8.jsonl`, `synthetic_calib.jsonl` and `tiny.jsonl` from it.

Every item is drawn from its own seeded RNG, so the first m items of a set of n are the same items as a
set of m (a `limit` on a bundled file is a fair sample of it), and items past the bundled ones are fresh
items of the same set:

    .venv/bin/python research/datasets/synthetic_set.py --first 532 --n 100 --out out/fresh100.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvboost_rag.bench.data import write_items

SYSTEM = "Answer the question using only the documents. Reply with the answer only."


# ---------------------------------------------------------------------------------------------------
# Synthetic set: invented entities
#
# Names are a shared stem plus different endings (Halvorsen, Halvard, Halverton...), so the documents
# of one item look alike. Filler sentences carry no numbers, names or places: the only values in a
# document are its facts, and every document of an item gives each fact a different value.

_STEMS = (
    "Halv", "Brenn", "Ost", "Kest", "Wend", "Rav", "Sel", "Dov", "Gran", "Lind", "Mald", "Pell", "Stav",
    "Tarr", "Corr", "Fenn", "Garr", "Hask", "Jarv", "Lev", "Morr", "Nord", "Rosk", "Sund", "Tull",
    "Varr", "Bell", "Carr", "Ell", "Gild",
)
# All start with a vowel, and none begins another, so no name is part of a look-alike's name.
_ENDINGS = (
    "ard", "orsen", "erton", "ington", "ersby", "enholm", "erfield", "eridge", "ewick", "esford",
    "ingham", "anby", "ersley", "ecombe", "estad", "ander", "ett", "ory", "umber", "athorpe",
)
_FIRST_NAMES = (
    "Margit", "Tobias", "Ilse", "Edwin", "Rosalind", "Anselm", "Brigitta", "Caspar", "Dagny", "Elias",
    "Freya", "Gustav", "Hedda", "Ingmar", "Johanna", "Konrad", "Liesel", "Magnus", "Nora", "Oskar",
    "Petra", "Rupert", "Solveig", "Theodor", "Ursula", "Viggo", "Agnes", "Bertram", "Clara", "Dorothea",
    "Emil", "Felix", "Greta", "Harald", "Jonas", "Karin", "Leopold", "Matilda", "Edda", "Anton",
)
_SURNAMES = (
    "Lindqvist", "Whitcombe", "Farrant", "Berglund", "Castellan", "Drummond", "Eckhart", "Falk", "Gorrie",
    "Hartwell", "Jessop", "Kinloch", "Lomax", "Mortensen", "Navarre", "Ormerod", "Pryce", "Quayle",
    "Rasmussen", "Strand", "Tennant", "Vance", "Wexley", "Yardley", "Abbott", "Blackwood", "Cromer",
    "Dunning", "Ellery", "Fairbairn", "Grieve", "Holloway", "Ingram", "Kershaw", "Lyle", "Marlowe",
    "Nesbitt", "Pennock", "Rook", "Thistlewood", "Upjohn", "Vesey", "Wardle",
)
_TOWNS = (
    "Amberlow", "Coldharbour", "Dunmere", "Eastwold", "Fallowmead", "Greyhaven", "Hollin Cross",
    "Millbeck", "Northwick", "Oakhollow", "Pebblestone", "Redfern", "Saltmarsh", "Underhill",
    "Westerleigh", "Wrenfold", "Yarrowby", "Ashcombe", "Birchmoor", "Copperfield", "Deepdale", "Elmstead",
    "Foxley", "Glenmorrow", "Inchbrook", "Lowater", "Marram Sands", "Netherby", "Orchard Vale",
    "Port Sennet", "Quarry Hill", "Rookhaven", "Stonecross", "Tarnside", "Whinfell",
)
_RIVERS = (
    "Aldwen", "Brisk", "Carrow", "Dunnet", "Elvane", "Glassen", "Harle", "Isbel", "Jorva", "Kelden",
    "Lenna", "Merrow", "Nyle", "Orvel", "Pasca", "Quillan", "Rhee", "Sarne", "Tolley", "Ussel", "Vantry",
    "Wending", "Zell",
)
_MOUNTAINS = (
    "Tessel", "Arvel", "Corrin", "Brasse", "Dunhallow", "Errick", "Falden", "Gorsa", "Hennet", "Illary",
    "Jorden", "Kaskel", "Lorrimer", "Mellan", "Nessock", "Ouse Fell", "Prowle", "Quarne", "Redhallow",
    "Skarra",
)


@dataclass(frozen=True)
class _Fact:
    key: str
    value: str  # "year", "count", "person", "town", "river" or "mountain"
    # (statement, question) pairs: each document states the fact one way, and the question asks it
    # in the words of the answer document's statement, as a reader would who had just read it. A few
    # questions are worded otherwise where SmolLM2-135M answered the mirrored wording far less often.
    variants: tuple[tuple[str, str], ...]
    lo: int = 0  # range of a year or count
    hi: int = 0


@dataclass(frozen=True)
class _Kind:
    key: str
    core: str  # the exact name of the entity, from the stem and the flavour slots
    article: str  # "the " where the name takes one in running text
    ref: str  # how fillers refer to it
    flavours: tuple[dict, ...]  # one per item: subtype, product... so items of one kind differ
    openers: tuple[str, ...]
    facts: tuple[_Fact, ...]
    fillers: tuple[str, ...]


_COMPANY = _Kind(
    key="company",
    core="{stem} {trade}",
    article="the ",
    ref="the {place}",
    flavours=(
        {"trade": "Brewing Company", "place": "brewery", "product": "ales"},
        {"trade": "Rope Works", "place": "works", "product": "ropes"},
        {"trade": "Piano Company", "place": "company", "product": "pianos"},
        {"trade": "Biscuit Company", "place": "bakery", "product": "biscuits"},
        {"trade": "Candle Works", "place": "works", "product": "candles"},
        {"trade": "Clock Company", "place": "workshop", "product": "clocks"},
    ),
    openers=(
        "{Name} is a maker of {product} with a long local history.",
        "{Name} is a family business known for its {product}.",
        "{Name} has made {product} for many generations.",
    ),
    facts=(
        _Fact("founded", "year", (
            ("{Name} was founded in {value}.", "In what year was {name} founded?"),
            ("It was in {value} that {name} was founded.", "In what year was {name} founded?"),
            ("{Name} first opened its doors in {value}.", "In what year did {name} first open its doors?"),
        ), 1760, 1960),
        _Fact("employees", "count", (
            ("{Name} employs {value} people.", "How many people does {name} employ?"),
            ("Today {name} has {value} employees.", "How many employees does {name} have?"),
            ("The workforce of {name} numbers {value} people.", "How many people are in the workforce of {name}?"),
        ), 120, 9800),
        _Fact("founder", "person", (
            ("{Name} was founded by {value}.", "Who founded {name}?"),
            ("The founder of {name} was {value}.", "Who was the founder of {name}?"),
            ("{value} founded {name}.", "Who founded {name}?"),
        )),
        _Fact("town", "town", (
            ("{Name} is based in the town of {value}.", "In which town is {name} based?"),
            ("The headquarters of {name} are in the town of {value}.",
             "In which town are the headquarters of {name}?"),
            ("{Name} has its home in the town of {value}.", "In which town does {name} have its home?"),
        )),
    ),
    fillers=(
        "{Ref} began as a small family workshop and grew slowly over several generations.",
        "Visitors often remark on the busy sounds that drift from the yard on warm afternoons.",
        "Much of the original building still stands, although the roof was replaced after a severe storm.",
        "Its {product} are sold in shops and markets throughout the surrounding district.",
        "Local historians have written at length about the early years of {ref}.",
        "The firm has always preferred to train its own workers rather than hire from outside.",
        "A small museum beside the main gate tells the story of how {product} were made in earlier times.",
        "During difficult winters {ref} kept its doors open and paid its workers in full.",
        "The company crest, a heron standing in reeds, appears on every crate that leaves the yard.",
        "{Ref} has won praise at regional fairs for the quality and consistency of its {product}.",
        "Its managers have turned down several offers to sell the business to larger rivals.",
        "Each spring the staff hold a modest celebration in the courtyard to mark the new season.",
        "The old delivery carts were replaced by motor vans long ago, but one cart is kept on display.",
        "Critics have sometimes called its methods old-fashioned, yet customers remain loyal.",
        "Apprentices at {ref} spend their first months learning every stage of the work by hand.",
        "The archive of {ref} holds letters, order books and drawings from its earliest days.",
        "Nearby residents regard {ref} as a landmark and a source of steady local work.",
        "A fire once destroyed the storehouse, and rebuilding it took the better part of a year.",
        "Today the business is run by a small board that still meets in the original office.",
    ),
)

_TOWN = _Kind(
    key="town",
    core="{stem}",
    article="",
    ref="the town",
    flavours=({"region": "valley"}, {"region": "county"}, {"region": "district"}),
    openers=(
        "{Name} is a market town in a quiet part of the {region}.",
        "{Name} is a small town with a long and varied history.",
        "{Name} is an old town known across the {region} for its weekly market.",
    ),
    facts=(
        _Fact("founded", "year", (
            ("{Name} was founded in {value}.", "What year was the town of {name} founded in?"),
            ("The town of {name} was founded in {value}.", "What year was the town of {name} founded in?"),
            ("{Name} dates back to {value}, when it was founded.",
             "What year was the town of {name} founded in?"),
        ), 1150, 1890),
        _Fact("population", "count", (
            ("{Name} has a population of {value}.", "What is the population of the town of {name}?"),
            ("The population of {name} stands at {value}.", "What is the population of the town of {name}?"),
            ("{Name} is home to {value} people.", "How many people live in the town of {name}?"),
        ), 1200, 96000),
        _Fact("river", "river", (
            ("{Name} stands on the River {value}.", "On which river does the town of {name} stand?"),
            ("The River {value} flows through the middle of {name}.",
             "Which river flows through the middle of the town of {name}?"),
            ("{Name} was built on the banks of the River {value}.",
             "On the banks of which river was the town of {name} built?"),
        )),
        _Fact("mayor", "person", (
            ("The current mayor of {name} is {value}.", "Who is the current mayor of the town of {name}?"),
            ("{Name} is led by its mayor, {value}.", "Who is the mayor of the town of {name}?"),
            ("{value} serves as the mayor of {name}.", "Who serves as the mayor of the town of {name}?"),
        )),
    ),
    fillers=(
        "The town grew up around a market square that is still used on Saturdays.",
        "The parish church, built of grey local stone, stands at the top of the high street.",
        "Many of the older houses have steep slate roofs and narrow windows.",
        "The town is surrounded by farmland, orchards and low wooded hills.",
        "A weekly newspaper has been printed in the town for as long as anyone can remember.",
        "In summer the streets fill with walkers who come to explore the countryside nearby.",
        "Its railway station was closed for some years but reopened after a local campaign.",
        "The old grammar school now serves as a library and community hall.",
        "Residents take great pride in the flower displays that line the main bridge each spring.",
        "A small museum displays tools, maps and photographs from earlier centuries.",
        "The annual fair draws visitors from villages across the whole {region}.",
        "Several inns claim to be the oldest in the town, and the argument has never been settled.",
        "Weaving and boatbuilding were once important trades, though few people follow them today.",
        "The council has worked hard to protect the historic centre from heavy traffic.",
        "Local bakers are known for a dark fruit loaf that is sold only in the autumn.",
        "Footpaths lead from the edge of the town to a ruined abbey in the woods.",
        "The town hall clock is said to have stopped only once, on the night of a great storm.",
        "Young people often leave for the cities, but many return in later life.",
    ),
)

_PERSON = _Kind(
    key="person",
    core="{first} {stem}",
    article="",
    ref="{stem}",
    flavours=(
        {"profession": "painter", "works": "paintings", "did": "completed", "do": "complete",
         "field": "painting", "room": "studio"},
        {"profession": "composer", "works": "songs", "did": "wrote", "do": "write",
         "field": "music", "room": "music room"},
        {"profession": "botanist", "works": "plant species", "did": "described", "do": "describe",
         "field": "botany", "room": "glasshouse"},
        {"profession": "cartographer", "works": "maps", "did": "drew", "do": "draw",
         "field": "map-making", "room": "drawing office"},
        {"profession": "poet", "works": "poems", "did": "published", "do": "publish",
         "field": "poetry", "room": "study"},
        {"profession": "architect", "works": "buildings", "did": "designed", "do": "design",
         "field": "architecture", "room": "drawing office"},
    ),
    openers=(
        "{Name} was a {profession} whose work is still admired today.",
        "{Name} was a {profession} of quiet but lasting reputation.",
        "Among the {profession}s of that era, {name} stands out for patient, careful work.",
    ),
    facts=(
        _Fact("born", "year", (
            ("{Name} was born in {value}.", "In what year was the {profession} {name} born?"),
            ("Records show that {name} was born in the year {value}.",
             "In what year was the {profession} {name} born?"),
            ("The {profession} {name} was born in {value}.", "In what year was the {profession} {name} born?"),
        ), 1720, 1950),
        _Fact("birthplace", "town", (
            ("{Name} was born in the town of {value}.", "In which town was the {profession} {name} born?"),
            ("The town of {value} was the birthplace of {name}.",
             "Which town was the birthplace of the {profession} {name}?"),
            ("{Name} came from the town of {value}.", "Which town did the {profession} {name} come from?"),
        )),
        _Fact("works", "count", (
            ("{Name} {did} {value} {works} in total.", "How many {works} did the {profession} {name} {do} in total?"),
            ("Over a long career, {name} {did} {value} {works}.", "How many {works} did the {profession} {name} {do}?"),
            ("In all, {name} {did} {value} {works}.", "How many {works} did the {profession} {name} {do}?"),
        ), 100, 900),
        _Fact("teacher", "person", (
            ("The teacher of {name} was {value}.", "Who was the teacher of the {profession} {name}?"),
            ("{Name} studied {field} under {value}.", "Under whom did the {profession} {name} study {field}?"),
            ("{Name} was taught {field} by {value}.", "Who taught {field} to the {profession} {name}?"),
        )),
    ),
    fillers=(
        "{Ref} worked slowly and often revised a piece many times before calling it finished.",
        "Friends described {ref} as modest, generous and rather shy in company.",
        "Much of the best work was done in a small {room} overlooking a garden.",
        "Critics were divided at first, but opinion warmed over the following decades.",
        "{Ref} travelled widely and filled many notebooks with sketches and observations.",
        "Surviving letters reveal a sharp sense of humour and a love of long walks.",
        "In later life {ref} took on a few pupils and was remembered as a patient teacher.",
        "Several manuscripts were lost in a flood and never recovered.",
        "The work of {ref} is now held in public collections and private libraries alike.",
        "{Ref} never sought fame and rarely spoke about {field} in public.",
        "A small society devoted to the study of this work meets every few years.",
        "Younger colleagues have often named {ref} as an important influence.",
        "Money was often short, and {ref} sometimes took odd jobs to pay the rent.",
        "{Ref} kept a strict daily routine, working from early morning until noon.",
        "A biography written long afterwards brought the work to a much wider audience.",
        "Many details of {ref}'s private life remain uncertain.",
        "Those who knew {ref} said that every conversation returned sooner or later to {field}.",
    ),
)

_SHIP = _Kind(
    key="ship",
    core="{vessel} {stem}",
    article="the ",
    ref="the ship",
    flavours=(
        {"vessel": "steamship"}, {"vessel": "schooner"}, {"vessel": "clipper"},
        {"vessel": "paddle steamer"}, {"vessel": "barque"},
    ),
    openers=(
        "{Name} was a ship that sailed for many years along the northern coast.",
        "{Name} was a well-known vessel of her day.",
        "{Name} was a sturdy vessel, remembered by sailors long after her last voyage.",
    ),
    facts=(
        _Fact("launched", "year", (
            ("{Name} was launched in {value}.", "In what year was {name} launched?"),
            ("It was in {value} that {name} was launched.", "In what year was {name} launched?"),
            ("{Name} was launched from the shipyard in {value}.", "In what year was {name} launched?"),
        ), 1780, 1960),
        _Fact("crew", "count", (
            ("{Name} carried a crew of {value}.", "How large a crew did {name} carry?"),
            ("A crew of {value} sailed aboard {name}.", "How many crew sailed aboard {name}?"),
            ("{Name} needed a crew of {value} sailors.", "How many sailors did {name} need as crew?"),
        ), 100, 650),
        _Fact("captain", "person", (
            ("{Name} was commanded by Captain {value}.", "Who commanded {name}?"),
            ("The captain of {name} was {value}.", "Who was the captain of {name}?"),
            ("Captain {value} commanded {name}.", "Who commanded {name}?"),
        )),
        _Fact("port", "town", (
            ("The home port of {name} was {value}.", "Which town was the home port of {name}?"),
            ("{Name} sailed from her home port of {value}.", "Which town was the home port of {name}?"),
            ("{Name} was registered at the port of {value}.", "At which port was {name} registered?"),
        )),
    ),
    fillers=(
        "Her hull was painted dark green, with a narrow white band below the rail.",
        "On calm days she could be seen from the cliffs long before she reached the harbour.",
        "The ship carried timber, grain and mail, and sometimes a handful of passengers.",
        "Storms in the northern waters tested her many times, yet she was never badly damaged.",
        "Her cook was famous among sailors for a thick fish stew served on cold nights.",
        "A carved figure of a seabird decorated her bow.",
        "Passengers wrote of cramped cabins but a friendly and cheerful company on board.",
        "In harbour the ship was a favourite subject for local painters.",
        "Her logbooks, kept in careful handwriting, survive in a maritime archive.",
        "Ice in the northern channels sometimes forced her to wait for days at anchor.",
        "The ship was refitted more than once, and each refit made her a little faster.",
        "Children would gather on the quay whenever she came in to unload.",
        "A model of the ship stands in the window of a harbour tavern.",
        "Her final voyage was made in quiet weather, and she was broken up soon after.",
        "Insurance records describe her as sound, well kept and reliably handled.",
        "Sailors considered a berth on board a lucky posting.",
        "The bell from the ship now hangs in a small chapel near the docks.",
    ),
)

_OBSERVATORY = _Kind(
    key="observatory",
    core="{stem} Observatory",
    article="the ",
    ref="the observatory",
    flavours=({"subject": "faint stars"}, {"subject": "comets"}, {"subject": "the planets"},
              {"subject": "variable stars"}),
    openers=(
        "{Name} is a small research station devoted to the study of the night sky.",
        "{Name} is one of the oldest astronomical observatories in the region.",
        "{Name} is an observatory known for its clear skies and careful records.",
    ),
    facts=(
        _Fact("founded", "year", (
            ("{Name} was founded in {value}.", "In what year was {name} founded?"),
            ("It was in {value} that {name} was founded.", "In what year was {name} founded?"),
            ("{Name} first opened its doors in {value}.", "In what year did {name} first open its doors?"),
        ), 1780, 1990),
        _Fact("elevation", "count", (
            ("{Name} stands at an elevation of {value} metres.", "At what elevation, in metres, does {name} stand?"),
            ("{Name} sits {value} metres above sea level.", "How many metres above sea level does {name} sit?"),
            ("The elevation of {name} is {value} metres.", "What is the elevation of {name} in metres?"),
        ), 300, 4200),
        _Fact("director", "person", (
            ("The first director of {name} was {value}.", "Who was the first director of {name}?"),
            ("{value} served as the first director of {name}.", "Who served as the first director of {name}?"),
            ("{Name} was led in its early years by {value}.", "Who led {name} in its early years?"),
        )),
        _Fact("mountain", "mountain", (
            ("{Name} stands on the summit of {value}.", "On the summit of which mountain does {name} stand?"),
            ("{Name} was built high on the slopes of {value}.", "On the slopes of which mountain was {name} built?"),
            ("{Name} is perched on the top of {value}.", "On top of which mountain is {name} perched?"),
        )),
    ),
    fillers=(
        "The main dome turns on iron wheels and can be opened in a matter of minutes.",
        "Astronomers there have kept nightly weather records since the very first winter.",
        "A narrow mountain road leads up to the gates, and it is often closed by snow.",
        "Much of the early work there concerned the study of {subject}.",
        "The library holds star charts, logbooks and letters from astronomers abroad.",
        "On open evenings, visitors may look through the smaller telescopes.",
        "Lights in the valley below are kept low to protect the dark sky.",
        "The staff live on site for weeks at a time during the observing season.",
        "A small weather station beside the dome measures wind, cloud and humidity.",
        "Its photographic plates of {subject} are still consulted by researchers.",
        "Funding has always been modest, and much of the equipment was built by hand.",
        "The observatory has trained many young astronomers who later worked elsewhere.",
        "Clear, dry air makes the site well suited to careful measurement.",
        "In winter the buildings are heated by a single large stove.",
        "A collection of old instruments is displayed in the entrance hall.",
        "Reports from the observatory are published in a modest yearly bulletin.",
        "Meteor showers draw crowds of visitors to the slopes below the dome.",
    ),
)

KINDS = (_COMPANY, _TOWN, _PERSON, _SHIP, _OBSERVATORY)


def synthetic_items(n: int, k_docs: int = 8, words_per_doc: int = 150, seed: int = 0, first: int = 0) -> list[dict]:
    """`n` multi-document QA items about invented entities; one answer-bearing document among `k_docs`.

    Items `first` to `first + n - 1` of the set: `synthetic_items(n, first=m)` is
    `synthetic_items(m + n)[m:]`.
    """
    _check_sizes(n, k_docs, words_per_doc)
    if first < 0:
        raise ValueError(f"first must be >= 0, got {first}")
    return [_synthetic_item(i, k_docs, words_per_doc, seed)[0] for i in range(first, first + n)]


def _synthetic_item(i: int, k: int, words: int, seed: int) -> tuple[dict, list[str]]:
    """Item `i` of the set, and the exact entity name each document is about (the tests use them)."""
    rng = random.Random(f"synthetic:{seed}:{i}")
    target = _answer_position(seed, i, k)
    # Redraw the rare item where a value shows up by chance inside another (a count inside a year, a
    # river inside a town name): scoring is by containment, so no other value may contain the answer.
    for _ in range(100):
        item, names, values = _draw_item(rng, k, words, target)
        if _unambiguous(item, names[target], values):
            item["id"] = f"syn{seed}-{i:04d}-{item.pop('_tag')}"
            return _ordered(item), names
    raise RuntimeError(f"could not draw an unambiguous synthetic item {i} (seed {seed})")


def _answer_position(seed: int, i: int, k: int) -> int:
    # Each run of k consecutive items puts the answer once in every position: uniform over the
    # whole set, and within one of uniform over any prefix of it.
    positions = list(range(k))
    random.Random(f"synthetic:{seed}:positions:{i // k}").shuffle(positions)
    return positions[i % k]


def _draw_item(rng: random.Random, k: int, words: int, target: int) -> tuple[dict, list[str], list[str]]:
    """The item, each document's entity name, and every value stated anywhere but the answer."""
    kind = rng.choice(KINDS)
    flavour = dict(rng.choice(kind.flavours))
    stems = _look_alike_stems(rng, k)
    flavour["first"] = rng.choice(_FIRST_NAMES)  # shared, so people differ by surname only
    fact = rng.choice(kind.facts)
    values = {f.key: _draw_values(rng, f, k) for f in kind.facts}

    docs, names = [], []
    for j in range(k):
        slots = {**flavour, "stem": stems[j]}
        core = kind.core.format(**slots)
        slots.update(name=kind.article + core, Name=_cap(kind.article + core))
        slots.update(ref=kind.ref.format(**slots))
        slots["Ref"] = _cap(slots["ref"])
        variants = {f.key: rng.choice(f.variants) for f in kind.facts}
        statements = [_cap(variants[f.key][0].format(**slots, value=values[f.key][j])) for f in kind.facts]
        docs.append(_write_document(rng, kind, slots, statements, words))
        names.append(core)
        if j == target:
            question = variants[fact.key][1].format(**slots)

    answer = values[fact.key][target]
    item = {
        "system": SYSTEM,
        "documents": docs,
        "question": question,
        "answers": _answer_forms(fact.value, answer),
        "answer_doc": target,
        "_tag": f"{kind.key}-{fact.key}",
    }
    others = [v for f in kind.facts for v in values[f.key] if not (f is fact and v == answer)]
    return item, names, others


def _look_alike_stems(rng: random.Random, k: int) -> list[str]:
    # One stem per item with different endings; more stems only when k outruns the endings.
    stems = rng.sample(_STEMS, -(-k // len(_ENDINGS)))
    names = [s + e for s in stems for e in _ENDINGS]
    return [n.capitalize() for n in rng.sample(names, k)]


def _draw_values(rng: random.Random, fact: _Fact, k: int) -> list[str]:
    # Distinct across the documents of an item, so no distractor shares the answer.
    if fact.value == "year":
        return [str(y) for y in rng.sample(range(fact.lo, fact.hi + 1), k)]
    if fact.value == "count":
        return [f"{c:,}" for c in rng.sample(range(fact.lo, fact.hi + 1), k)]
    if fact.value == "person":
        # Distinct surnames too, so a reply of just the surname still names one document's value.
        return [f"{rng.choice(_FIRST_NAMES)} {s}" for s in _sample(rng, _SURNAMES, k)]
    if fact.value == "town":
        return _sample(rng, _TOWNS, k)
    if fact.value == "river":
        return _sample(rng, _RIVERS, k)
    if fact.value == "mountain":
        return [f"Mount {m}" for m in _sample(rng, _MOUNTAINS, k)]
    raise ValueError(f"unknown value type {fact.value!r}")


def _sample(rng: random.Random, pool: Sequence[str], k: int) -> list[str]:
    if k > len(pool):
        raise ValueError(f"k_docs={k} is more than the {len(pool)} distinct values available")
    return rng.sample(pool, k)


def _answer_forms(value_type: str, value: str) -> list[str]:
    """The value as written, then looser forms a correct reply might take."""
    forms = [value]
    if value_type == "count" and "," in value:
        forms.append(value.replace(",", ""))
    elif value_type == "river":
        forms = [f"River {value}", value]
    elif value_type == "mountain":
        forms.append(value.removeprefix("Mount "))
    elif value_type == "person":
        forms.append(value.split()[-1])  # surnames are distinct within an item
    return forms


def _write_document(rng: random.Random, kind: _Kind, slots: dict, statements: list[str], words: int) -> str:
    """Opener, then a lead that states the facts among a few fillers, then the remaining fillers.

    Facts sit in the first half or so of the article, as in an encyclopedia entry: SmolLM2-135M
    finds a fact there more often than near the end of a 150-word document.
    """
    opener = rng.choice(kind.openers).format(**slots)
    total = _count_words(opener) + sum(_count_words(s) for s in statements)
    fillers = []
    for template in rng.sample(kind.fillers, len(kind.fillers)):
        sentence = template.format(**slots)
        # Stop at the sentence that lands nearest the target length.
        if total + _count_words(sentence) / 2 > words:
            break
        fillers.append(sentence)
        total += _count_words(sentence)
    in_lead = len(fillers) // 3
    lead = statements + fillers[:in_lead]
    rng.shuffle(lead)
    sentences = [opener, *lead, *fillers[in_lead:]]
    # Two paragraphs once there is enough text, as a short article would have.
    if len(sentences) >= 8:
        cut = len(sentences) // 2
        return " ".join(sentences[:cut]) + "\n\n" + " ".join(sentences[cut:])
    return " ".join(sentences)


def _unambiguous(item: dict, target_name: str, other_values: list[str]) -> bool:
    docs, answers, target = item["documents"], item["answers"], item["answer_doc"]
    if answers[0] not in docs[target]:
        return False
    # Replying with any other value (a distractor's, or another fact's) must not count as correct.
    others = [v for value in other_values for v in (value, value.replace(",", ""))]
    if any(a in v for a in answers for v in others):
        return False
    if any(a in docs[target].replace(answers[0], "") for a in answers):
        return False
    rest = [d for j, d in enumerate(docs) if j != target]
    return not any(a in d or target_name in d for a in answers for d in rest)


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _ordered(item: dict) -> dict:
    # A stable key order keeps the JSONL readable and diffs small.
    return {key: item[key] for key in ("id", "system", "documents", "question", "answers", "answer_doc")
            if key in item}


def _count_words(text: str) -> int:
    return len(text.split())


def _check_sizes(n: int, k_docs: int, words_per_doc: int) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if k_docs < 1:
        raise ValueError(f"k_docs must be >= 1, got {k_docs}")
    if words_per_doc < 1:
        raise ValueError(f"words_per_doc must be >= 1, got {words_per_doc}")



# ---------------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100, help="number of items")
    parser.add_argument("--first", type=int, default=0, help="index of the first item (0: the set's start)")
    parser.add_argument("--k", type=int, default=8, help="documents per item")
    parser.add_argument("--words", type=int, default=150, help="about this many words per document")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="output file (default: stdout)")
    args = parser.parse_args(argv)

    items = synthetic_items(args.n, args.k, args.words, args.seed, first=args.first)
    if args.out is None:
        for item in items:
            sys.stdout.write(json.dumps(item, ensure_ascii=False) + "\n")
    else:
        write_items(items, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
