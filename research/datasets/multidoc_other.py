"""A held-out multi-document QA set, generated differently from the bundled synthetic one.

The fidelity guard and the repair settings were tuned on `kvboost_rag/bench/synthetic_*.jsonl`; this set is
for judging them on prompts they have not seen, and nothing may be tuned on it. It shares no entity kind,
name list or sentence template with the bundled sets' synthetic generator (`synthetic_set.py`; checked on every run,
for the name lists), and its prompts are laid out differently:

* six kinds of entity (chemical compounds, rivers, software releases, recipes, court cases, sports clubs),
  four facts each, several statement templates a fact; facts land anywhere in a document, among fillers
  that state no fact; some documents open with a title line, some run to two or three paragraphs;
* 3 to 10 documents an item and 60 to 250 words a document (drawn per document, then trimmed of fillers
  where an item would pass the token budget);
* three layouts, a third of the items each: `lookalike` (every document the same kind, with near-identical
  names: Dravonine / Dravonide, Borvik 3.7 / Borvik 3.8), `pair` (unrelated documents plus one or two
  look-alikes of the answer's entity), `mixed` (unrelated documents of mixed kinds, distinct names);
* the answer's position spread evenly over the relative positions of the item; system texts from a few
  phrasings or none at all (the key left out: the loader refuses an empty one); questions asked directly,
  as "According to the documents, ...", as a command ("Name the ...", "Give the ..."), or tersely
  ("Borvik 3.7: licence?").

Answers are short (a number, a name) with their accepted forms (a surname, a number without its comma);
every answer form appears in its document once and in no other document, so containment scoring cannot
credit a distractor's value.

    .venv/bin/python research/datasets/multidoc_other.py   # writes research/data/multidoc_other.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "research" / "data" / "multidoc_other.jsonl"
N_ITEMS = 60
SEED = 7919
# Documents joined by blank lines plus the question, in SmolLM2 tokens; the system text and the chat
# template add well under 50 more, so the whole prompt stays under ~1800.
TOKEN_BUDGET = 1750
MIN_WORDS, MAX_WORDS = 60, 250
MIN_DOCS, MAX_DOCS = 3, 10
LAYOUTS = ("lookalike", "pair", "mixed")

SYSTEMS = (
    None,  # no system message at all
    "Answer from the sources below. Be brief.",
    "Use the passages to answer. Give only the answer, in a few words.",
    "You are a helpful assistant. Read the documents and answer the question with a short phrase.",
    "Reply briefly, using only what the documents say.",
)
STYLES = ("direct", "according", "command", "terse")
_ACCORDING = ("According to the documents, ", "According to the sources, ", "Based on the passages above, ")

# ---------------------------------------------------------------------------------------------------
# Value pools: none of these names occurs in synthetic_set.py (see _check_disjoint)

_FIRST = (
    "Ansgar", "Beatrix", "Cosmo", "Delphine", "Esmond", "Fenella", "Gideon", "Hortense", "Isidore", "Jocasta",
    "Lucian", "Mireille", "Nikolai", "Odile", "Percival", "Rosamund", "Sabine", "Tancred", "Ulrika",
    "Valentin", "Wilhelmina", "Xavier", "Yvonne", "Zeno", "Adelheid", "Bastian", "Cordelia", "Dmitri",
    "Evadne", "Florian", "Gwendolen", "Hilarion", "Imogen", "Jasper", "Kasimir", "Leocadia", "Marius",
    "Ninian", "Octavia", "Philippa",
)
_SURNAME = (
    "Achterberg", "Brightwater", "Carbonell", "Dauphin", "Eberhardt", "Fitzmaurice", "Galloway", "Haverkamp",
    "Iredale", "Jourdain", "Kowalczyk", "Lachance", "Mendelsohn", "Northcott", "Okonkwo", "Penhaligon",
    "Quennell", "Rothbury", "Szabo", "Trevelyan", "Uttley", "Valdivia", "Westergaard", "Yeomans", "Zabinski",
    "Abernethy", "Belcourt", "Cheverton", "Delacroix", "Esterhazy", "Fairweather", "Gundersen", "Hazeldine",
    "Ibarra", "Jablonski", "Kilbride", "Lestrange", "Moncrieff", "Nakamura", "Oyelaran", "Pellegrini",
    "Radcliffe", "Sandoval", "Thorburn", "Verhoeven", "Winterbottom",
)
_CITY = (
    "Kessarine", "Port Alvary", "Drummel", "Vossberg", "Ilmarsk", "Caradun", "Sallowgate", "Quenmoor",
    "Tiverholt", "Lorrens", "Ostwyke", "Harnsey", "Belvarre", "Castelmonte", "Wyverne", "Nantfield",
    "Runcorran", "Elvaston", "Graymarsh", "Marlbridge", "Stavenport", "Tollmere", "Aberlin", "Dunraven",
    "Fenchester", "Gallowmere", "Hythebury", "Kingsmoor", "Redwater", "Saint Orlac",
)
# Stems of lakes, seas, grounds and regions ("Lake Orvin", "the Bay of Kilmory", "Halsey Park").
_PLACE = (
    "Orvin", "Braddock", "Kilmory", "Halsey", "Morwen", "Pentreath", "Gollan", "Rissing", "Ulverly",
    "Fothering", "Ashlar", "Brannagh", "Cullen", "Drever", "Eskin", "Farrowe", "Gilmour", "Hesketh", "Ivel",
    "Jessamy", "Kinnear", "Lorne", "Mossop", "Nairn", "Oldcastle", "Pennard", "Quarrie", "Rathlin", "Strathy",
    "Tregaron", "Ullock", "Vallance", "Wyke", "Yoxall", "Zennor", "Amersby", "Barrowden", "Colwyn", "Elsdon",
    "Fiskerton", "Glaisdale", "Hawksmoor", "Illogan", "Kirkland", "Lanark",
)
_INGREDIENT = (
    "smoked eel", "chickpeas", "quince", "celeriac", "buckwheat", "salt cod", "black lentils", "chestnuts",
    "sorrel", "pearl barley", "rhubarb", "mussels", "kohlrabi", "damsons", "venison", "sauerkraut", "parsnips",
    "haricot beans", "smoked mackerel", "wild garlic",
)
_NICKNAME = (
    "Herons", "Otters", "Badgers", "Kestrels", "Millers", "Potters", "Lanterns", "Anchors", "Stags", "Magpies",
    "Ravens", "Hornets", "Tanners", "Quarrymen", "Saddlers", "Shrimps", "Cobblers", "Larks", "Bargemen", "Glovers",
)
_LANGUAGE = ("OCaml", "Haskell", "Erlang", "Elixir", "Kotlin", "Fortran", "Clojure", "Scala", "Smalltalk",
             "Prolog", "Racket", "Pascal", "COBOL", "Perl")
# (as written, shorter accepted forms); no bare form that hides in common words ("mpl" in "simple").
_LICENCE = (
    ("Apache-2.0", "Apache"), ("BSD-3-Clause", "BSD"), ("MPL-2.0",), ("GPL-3.0",), ("LGPL-2.1", "LGPL"),
    ("EPL-2.0",), ("Zlib",), ("Artistic-2.0", "Artistic"), ("CDDL-1.0", "CDDL"), ("EUPL-1.2", "EUPL"),
    ("BSL-1.0",), ("OSL-3.0",),
)


@dataclass(frozen=True)
class Value:
    text: str  # as written in the document
    forms: tuple[str, ...]  # accepted answers, the first the canonical one


def _person(rng: random.Random) -> Value:
    first, last = rng.choice(_FIRST), rng.choice(_SURNAME)
    return Value(f"{first} {last}", (f"{first} {last}", last))


def _number(lo: int, hi: int, step: int = 1) -> Callable[[random.Random], Value]:
    def draw(rng: random.Random) -> Value:
        n = rng.randrange(lo, hi + 1, step)
        return Value(f"{n:,}", (f"{n:,}", str(n)) if n >= 1000 else (str(n),))
    return draw


def _decimal(rng: random.Random) -> Value:
    x = f"{rng.randrange(600, 4800) / 10:.1f}"
    return Value(x, (x,))


def _placed(*patterns: str) -> Callable[[random.Random], Value]:
    # "Lake {}" -> Value("Lake Orvin", ("Lake Orvin", "Orvin")); a leading "the " is not part of the answer.
    def draw(rng: random.Random) -> Value:
        stem = rng.choice(_PLACE)
        text = rng.choice(patterns).format(stem)
        return Value(text, (text.removeprefix("the "), stem))
    return draw


def _pick(pool: Sequence[str], plural_forms: bool = False) -> Callable[[random.Random], Value]:
    def draw(rng: random.Random) -> Value:
        v = rng.choice(pool)
        forms = (v, v[:-1]) if plural_forms and v.endswith("s") else (v,)
        return Value(v, forms)
    return draw


def _licence(rng: random.Random) -> Value:
    forms = rng.choice(_LICENCE)
    return Value(forms[0], forms)


def _nickname(rng: random.Random) -> Value:
    v = rng.choice(_NICKNAME)
    return Value(f"the {v}", (v,))


# ---------------------------------------------------------------------------------------------------
# Kinds of entity


@dataclass(frozen=True)
class Fact:
    key: str
    draw: Callable[[random.Random], Value]
    statements: tuple[str, ...]  # {Name}/{name}: the entity; {Ref}/{ref}: "the compound"...; {value}
    question: str  # asked directly
    command: str  # "Name the ...", "Give the ..."
    terse: str  # "{Name}: licence?"


@dataclass(frozen=True)
class Kind:
    key: str
    article: str  # "the " where the name takes one in running text
    ref: str
    label: str  # for title lines: "Compound profile"
    bases: tuple[str, ...]
    slots: dict[str, tuple[str, ...]]  # drawn once an entity: suffix, dish, sport...
    core: str  # the name from {base} and the slots
    alike: tuple[str, ...]  # slots that a look-alike may change besides the base
    openers: tuple[str, ...]
    facts: tuple[Fact, ...]
    fillers: tuple[str, ...]


COMPOUND = Kind(
    key="compound", article="", ref="the compound", label="Compound profile",
    bases=("Dravon", "Pelistr", "Quoral", "Tesmir", "Olvan", "Brisen", "Caldor", "Myrex", "Zentor", "Ilvar",
           "Sorbel", "Trevak", "Nolvex", "Harsil", "Ketrin", "Vasgar", "Lumor", "Ferrox", "Gavrel", "Orpham",
           "Syndal", "Belvox", "Cymar", "Dexar", "Jolvan", "Kronel", "Phenar", "Rutiv"),
    slots={"suffix": ("ine", "ide", "ane", "ol", "ate", "ene")},
    core="{base}{suffix}", alike=("suffix",),
    openers=(
        "{Name} is a crystalline compound first described in the chemical literature long ago.",
        "{Name} is an organic salt studied mainly for its unusual solubility.",
        "Chemists know {name} as a stable solid that keeps well in sealed jars.",
        "{Name} is a compound of some interest to laboratories that work on dyes and coatings.",
    ),
    facts=(
        Fact("melting_point", _number(41, 389), (
            "{Name} melts at {value} °C.", "The melting point of {name} is {value} °C.",
            "When heated, {ref} turns liquid at {value} degrees Celsius.",
            "Samples of {name} begin to melt once they reach {value} °C."),
            "What is the melting point of {name}, in degrees Celsius?",
            "Give the melting point of {name} in °C.", "{Name}: melting point (°C)?"),
        Fact("molar_mass", _decimal, (
            "{Name} has a molar mass of {value} g/mol.", "Its molar mass is {value} grams per mole.",
            "The molar mass of {name} comes to {value} g/mol."),
            "What is the molar mass of {name} in g/mol?",
            "State the molar mass of {name} in grams per mole.", "{Name}: molar mass in g/mol?"),
        Fact("discoverer", _person, (
            "{Name} was discovered by the chemist {value}.",
            "The chemist {value} was the first to isolate {name} and is credited with its discovery.",
            "Credit for discovering {ref} goes to {value}."),
            "Who discovered {name}?", "Name the chemist who discovered {name}.", "{Name}: discovered by whom?"),
        Fact("city", _pick(_CITY), (
            "{Name} was first made in a laboratory in {value}.",
            "The first samples of {ref} were produced in the city of {value}.",
            "It was in {value} that {name} was first synthesised."),
            "In which city was {name} first made?", "Name the city where {name} was first made.",
            "{Name}: city of first synthesis?"),
    ),
    fillers=(
        "{Ref} dissolves slowly in water but readily in warm alcohol.",
        "Most suppliers ship {ref} in brown glass to keep light away from it.",
        "Its crystals are brittle and break along clean, flat faces.",
        "A faint sharp smell is noticeable when a jar of {ref} is first opened.",
        "Early reports on {name} were short and written mainly for other specialists.",
        "Several teaching laboratories use {ref} in practical classes on purification.",
        "Safety sheets advise gloves and goggles when handling the powder.",
        "The structure of {ref} was settled only after years of careful argument.",
        "Small amounts are used to stabilise certain varnishes and inks.",
        "Impure samples tend to clump together in damp weather.",
        "{Name} has never been produced on a large industrial scale.",
        "Students are often asked to recrystallise {ref} as an exercise in patience.",
        "Researchers continue to publish occasional notes on its behaviour under pressure.",
        "{Ref} is not known to occur naturally.",
    ),
)

RIVER = Kind(
    key="river", article="the ", ref="the river", label="River notes",
    bases=("Ysker", "Maddow", "Tarsk", "Olvey", "Brannow", "Quenby", "Arrant", "Lissom", "Dewent", "Soral",
           "Munby", "Yarrel", "Fendrel", "Ostrey", "Kirran", "Wenlow", "Skellan", "Hobrin", "Pellow", "Norwen",
           "Ruddle", "Amblen", "Vellan", "Tamsin", "Gorwy"),
    slots={}, core="{base}", alike=(),
    openers=(
        "{Name} is a river that winds through quiet farmland and wooded gorges.",
        "{Name} is one of the longer rivers of its region and was once an important route for barges.",
        "Anglers and walkers know {name} well for its clear water and steep banks.",
        "{Name} is a slow, broad river with many meanders along its lower course.",
    ),
    facts=(
        Fact("source", _placed("Lake {}", "the {} Springs", "the {} Glacier", "the {} Moss"), (
            "{Name} rises in {value}.", "The source of {name} is {value}.",
            "{Ref} begins its journey in {value}, high in the hills.",
            "From its source in {value}, {ref} flows steadily downhill."),
            "What is the source of {name}?", "Name the source of {name}.", "{Name}: source?"),
        Fact("length", _number(40, 2900), (
            "{Name} is {value} kilometres long.", "Its total length is {value} kilometres.",
            "From source to mouth, {ref} runs for {value} kilometres."),
            "How long is {name}, in kilometres?", "Give the length of {name} in kilometres.",
            "{Name}: length in km?"),
        Fact("mouth", _placed("the Bay of {}", "the {} Sound", "the Gulf of {}", "the {} Sea"), (
            "{Name} flows into {value}.", "{Ref} reaches the sea at {value}.",
            "At its mouth, {name} empties into {value}."),
            "Into which body of water does {name} flow?", "Name the body of water into which {name} flows.",
            "{Name}: mouth?"),
        Fact("basin", _number(900, 98000, 10), (
            "{Name} drains a basin of {value} square kilometres.",
            "The drainage basin of {name} covers {value} square kilometres.",
            "Rain falling on {value} square kilometres of land finds its way into {ref}."),
            "How large is the drainage basin of {name}, in square kilometres?",
            "Give the area of the drainage basin of {name} in square kilometres.", "{Name}: basin area in km²?"),
    ),
    fillers=(
        "Willows and alders crowd the banks along much of its middle course.",
        "In spring the water runs fast and brown with melted snow.",
        "Several old mills stand beside {ref}, though none of them still grinds grain.",
        "Otters have returned to the quieter reaches after many years of absence.",
        "A towpath follows the water for a long stretch and is popular with cyclists.",
        "Floods in past centuries shaped the villages that grew up along its banks.",
        "Local legends tell of a drowned village lying beneath one of its deep pools.",
        "Stone bridges of different ages cross {ref} at regular intervals.",
        "The lower valley is wide and flat, with rich meadows on both sides.",
        "Boatmen once carried timber and wool downstream on shallow barges.",
        "Fishing rights on {name} have been argued over for generations.",
        "Painters have long been drawn to the gorge where the water narrows.",
        "In dry summers, pale gravel bars appear in the middle of the channel.",
        "Conservation groups monitor the water quality every season.",
    ),
)

RELEASE = Kind(
    key="release", article="", ref="the release", label="Release summary",
    bases=("Quillet", "Borvik", "Nectra", "Pylonix", "Tarvo", "Zephrin", "Lumenkit", "Fennix", "Halcyo",
           "Corvane", "Grisby", "Velto", "Ambrel", "Dunlin", "Ostinato", "Brindle", "Tessera", "Junco",
           "Heddle", "Lantana", "Pollux", "Rennet", "Sextant", "Tamarack", "Wicket"),
    slots={"version": tuple(f"{a}.{b}" for a in range(1, 10) for b in range(0, 13)),
           "purpose": ("a job scheduler", "a static site generator", "a geospatial toolkit",
                       "a database migration tool", "an audio processing library", "a plotting library",
                       "a message queue client", "a text search engine")},
    core="{base} {version}", alike=("version",),
    openers=(
        "{Name} is a release of {purpose}.",
        "{Name} is a stable version of {purpose} maintained by volunteers.",
        "{Name} is a maintenance release of {purpose}.",
        "{Name} brought a number of changes to {purpose}.",
    ),
    facts=(
        Fact("maintainer", _person, (
            "{Name} was prepared by its lead maintainer, {value}.",
            "The lead maintainer for {ref} was {value}.", "{value} served as lead maintainer of {name}."),
            "Who was the lead maintainer of {name}?", "Name the lead maintainer of {name}.",
            "{Name}: lead maintainer?"),
        Fact("licence", _licence, (
            "{Name} is distributed under the {value} licence.",
            "{Ref} is published under the terms of the {value} licence.",
            "Its code is licensed under {value}."),
            "Under which licence is {name} distributed?", "Name the licence under which {name} is distributed.",
            "{Name}: licence?"),
        Fact("language", _pick(_LANGUAGE), (
            "{Name} is written in {value}.", "The code base of {name} is written almost entirely in {value}.",
            "Developers wrote {ref} in {value}."),
            "In which programming language is {name} written?",
            "Name the programming language {name} is written in.", "{Name}: implementation language?"),
        Fact("contributors", _number(14, 960), (
            "{value} people contributed code to {name}.", "A total of {value} contributors worked on {ref}.",
            "The changelog of {name} credits {value} contributors."),
            "How many contributors worked on {name}?", "Give the number of contributors to {name}.",
            "{Name}: number of contributors?"),
    ),
    fillers=(
        "The release notes list a long series of small fixes and clearer error messages.",
        "Documentation for {ref} was rewritten to make the examples easier to follow.",
        "Several deprecated functions were finally removed in this version.",
        "Users upgrading from older versions are advised to read the migration guide first.",
        "The project keeps its discussions on a public mailing list.",
        "Automated tests now run on every change before it can be merged.",
        "Packaging was simplified, so installing {ref} takes a single command.",
        "Some plugins written for earlier versions will need minor changes.",
        "The maintainers thanked the community for reporting problems quickly.",
        "Start-up time improved noticeably on slower machines.",
        "A new configuration format replaces the older one, which still works for now.",
        "Bug reports are triaged by volunteers during regular weekly meetings.",
        "The project logo, a small paper boat, appears on the download page.",
        "Security fixes from the previous cycle are included in full.",
    ),
)

RECIPE = Kind(
    key="recipe", article="", ref="the dish", label="Recipe",
    bases=("Varnholm", "Eskerby", "Marrowdean", "Quintree", "Hollesby", "Drumcairn", "Pennycross", "Wexholt",
           "Rushmere", "Skelwith", "Tarrow", "Ullsby", "Yelverton", "Orrisdale", "Linthorpe", "Kelsworth",
           "Harlowe", "Glenarrow", "Saffrey", "Nethercott", "Whitbarrow", "Cawdrey", "Bramwick", "Dolwen"),
    slots={"dish": ("hotpot", "pie", "tart", "casserole", "bake", "loaf", "gratin", "pudding", "pasty",
                    "crumble")},
    core="{base} {dish}", alike=("dish",),
    openers=(
        "{Name} is a hearty dish served on cold evenings.",
        "{Name} is a country recipe handed down through many kitchens.",
        "Cooks prize {name} for its simple method and generous flavour.",
        "{Name} is a festive dish that often appears at harvest suppers.",
    ),
    facts=(
        Fact("ingredient", _pick(_INGREDIENT, plural_forms=True), (
            "The main ingredient of {name} is {value}.", "{Name} is made chiefly from {value}.",
            "{Ref} is built around {value}.", "Above all, {name} depends on {value}."),
            "What is the main ingredient of {name}?", "Name the main ingredient of {name}.",
            "{Name}: main ingredient?"),
        Fact("oven", _number(150, 250, 5), (
            "{Name} is baked at {value} °C.", "The oven should be set to {value} °C for {ref}.",
            "Cooks bake it in an oven heated to {value} degrees Celsius."),
            "At what oven temperature, in °C, is {name} baked?",
            "Give the oven temperature for {name} in degrees Celsius.", "{Name}: oven temperature (°C)?"),
        Fact("minutes", _number(20, 190), (
            "{Name} needs {value} minutes in the oven.", "{Ref} cooks for {value} minutes.",
            "Allow {value} minutes of cooking time for {name}."),
            "How many minutes does {name} cook for?", "Give the cooking time of {name} in minutes.",
            "{Name}: cooking time in minutes?"),
        Fact("region", _placed("the {} Uplands", "the {} Fens", "the {} Coast", "the {} Valley"), (
            "{Name} comes from {value}.", "The recipe originated in {value}.",
            "{Name} is a speciality of {value}."),
            "Which region does {name} come from?", "Name the region where {name} originated.",
            "{Name}: region of origin?"),
    ),
    fillers=(
        "Some households add a spoonful of mustard just before serving.",
        "Leftovers are said to taste even better on the following day.",
        "{Ref} is usually served with thick slices of bread and butter.",
        "Older recipes call for a heavy iron pot with a tight lid.",
        "Many cooks insist that the vegetables be cut by hand rather than in a machine.",
        "A sprinkling of fresh herbs brightens {ref} at the table.",
        "Arguments about the proper seasoning have divided families for generations.",
        "{Name} is filling enough to serve as a meal on its own.",
        "Restaurants in the cities have recently begun to offer lighter versions.",
        "The crust should be golden and crisp at the edges.",
        "Children often help by layering the ingredients in the dish.",
        "A simple salad makes a good companion on the side.",
        "Cookery writers describe it as honest, unfussy food.",
        "It keeps well in a cool larder for a few days.",
    ),
)

CASE = Kind(
    key="case", article="", ref="the case", label="Case summary",
    bases=("Harrowell", "Tessendorf", "Marchbank", "Ottley", "Brassington", "Fairclough", "Gorringe",
           "Hebblethwaite", "Inchcape", "Jellicoe", "Kettering", "Lovibond", "Mallinson", "Nettleship",
           "Pargeter", "Ravenscroft", "Sowerby", "Thackray", "Vosper", "Wimbush", "Yelland", "Birtwistle",
           "Catterall"),
    slots={"party": ("Ostley Mills", "the Harbour Board", "Crandle Holdings", "Pinfold and Sons",
                     "the Weavers' Guild", "Blackmere Estates", "Tolland Shipping", "the Parish Council",
                     "Gorsebrook Farms", "Silverlake Bank", "Fenwick Carriers", "Ashdown Quarries"),
           "matter": ("the sale of a mill", "water rights on a farm", "an unpaid shipping bill",
                      "a collapsed warehouse roof", "a disputed will", "a broken supply contract",
                      "damage to a vineyard", "a debt between merchants")},
    core="{base} v. {party}", alike=(),
    openers=(
        "{Name} was a civil case about {matter}.",
        "{Name} is remembered as a dispute over {matter}.",
        "The case of {name} arose from a quarrel about {matter}.",
        "Law students still read {name}, a dispute concerning {matter}.",
    ),
    facts=(
        Fact("judge", _person, (
            "{Name} was heard by Judge {value}.", "Judge {value} presided over {ref}.",
            "The presiding judge in {name} was {value}."),
            "Which judge presided over {name}?", "Name the judge who presided over {name}.",
            "{Name}: presiding judge?"),
        Fact("damages", _number(1200, 96000, 50), (
            "The court awarded damages of {value} crowns in {name}.",
            "{Name} ended with an award of {value} crowns in damages.",
            "The winning party received {value} crowns in damages."),
            "How many crowns in damages were awarded in {name}?", "Give the damages awarded in {name}, in crowns.",
            "{Name}: damages awarded (crowns)?"),
        Fact("days", _number(12, 190), (
            "The trial in {name} lasted {value} days.", "Hearings ran for {value} days before a verdict was given.",
            "{Name} took {value} days to try."),
            "How many days did the trial in {name} last?", "Give the length of the trial in {name} in days.",
            "{Name}: length of trial in days?"),
        Fact("city", _pick(_CITY), (
            "{Name} was tried in {value}.", "{Ref} was heard at the court in {value}.",
            "Proceedings in {name} took place in the city of {value}."),
            "In which city was {name} tried?", "Name the city where {name} was tried.", "{Name}: city of trial?"),
    ),
    fillers=(
        "Both parties were represented by experienced advocates.",
        "The public gallery was full on most days of the hearing.",
        "Newspapers followed {ref} closely and printed long reports of the evidence.",
        "Much of the argument turned on the wording of a single letter.",
        "Witnesses disagreed sharply about what had been said at a meeting.",
        "The judgment was later cited in several textbooks on contract law.",
        "An appeal was considered but never pursued.",
        "Legal commentators praised the clarity of the written decision.",
        "{Ref} is often used to teach students how courts weigh conflicting testimony.",
        "Neither side was fully satisfied with the outcome.",
        "The original court papers are kept in a regional archive.",
        "Some observers felt the dispute could easily have been settled privately.",
        "Expert evidence on accounting practices took up a large part of the hearing.",
        "The decision clarified how notice must be given between traders.",
    ),
)

CLUB = Kind(
    key="club", article="", ref="the club", label="Club profile",
    bases=("Kelderby", "Ravensholm", "Stourley", "Cawthorne", "Millbury", "Penrose", "Tolworth",
           "Brackenfield", "Hexley", "Ormsby", "Quarrington", "Selwick", "Thornaby", "Wolvercote", "Yeadon",
           "Alderholt", "Brinscombe", "Carnforth", "Denholme", "Elstow", "Felsham", "Grindley", "Hatherleigh",
           "Ickworth"),
    slots={"suffix": ("Rovers", "Athletic", "Wanderers", "Albion", "Harriers", "Rangers"),
           "sport": ("football", "rugby", "hockey", "basketball")},
    core="{base} {suffix}", alike=("suffix",),
    openers=(
        "{Name} is a {sport} club with a loyal local following.",
        "{Name} plays {sport} in a regional league and draws large crowds.",
        "Supporters of {name} are known for their songs and their patience.",
        "{Name} is one of the oldest {sport} clubs in its league.",
    ),
    facts=(
        Fact("ground", _placed("{} Park", "{} Road", "{} Lane", "the {} Ground"), (
            "{Name} plays its home games at {value}.", "The home ground of {name} is {value}.",
            "Every home match of {ref} is played at {value}."),
            "What is the name of the home ground of {name}?", "Name the home ground of {name}.",
            "{Name}: home ground?"),
        Fact("capacity", _number(3000, 62000, 10), (
            "The ground of {name} holds {value} spectators.", "Its ground has room for {value} supporters.",
            "Up to {value} fans can watch a match at the ground of {name}."),
            "How many spectators can the ground of {name} hold?", "Give the capacity of the ground of {name}.",
            "{Name}: ground capacity?"),
        Fact("coach", _person, (
            "{Name} is coached by {value}.", "The head coach of {name} is {value}.",
            "{value} took charge of {ref} as head coach."),
            "Who is the head coach of {name}?", "Name the head coach of {name}.", "{Name}: head coach?"),
        Fact("nickname", _nickname, (
            "{Name} is nicknamed {value}.", "Fans call {ref} {value}.", "The nickname of {name} is {value}."),
            "What is the nickname of {name}?", "Give the nickname of {name}.", "{Name}: nickname?"),
    ),
    fillers=(
        "The club shop sells scarves, mugs and framed photographs of famous matches.",
        "Youth teams train on the pitches behind the main stand.",
        "Home games on winter evenings are played under floodlights.",
        "A bitter rivalry with a neighbouring club dates back generations.",
        "The supporters' trust helps to run several community projects.",
        "Promotion has been within reach in recent seasons but never quite won.",
        "Former players often return to coach the junior sides.",
        "Matchday programmes are collected eagerly by older fans.",
        "{Ref} has a reputation for developing young talent.",
        "The terraces were replaced by seating after a long fundraising campaign.",
        "Away supporters are housed in a small stand at the far end of the ground.",
        "Local businesses have sponsored the team shirts for many years.",
        "A statue of a former captain stands outside the main gate.",
        "The history of {ref} is told in a small museum beneath the stands.",
    ),
)

KINDS = (COMPOUND, RIVER, RELEASE, RECIPE, CASE, CLUB)

# Shared by every kind; like the kinds' fillers, they hold no digits and no value.
GENERIC_FILLERS = (
    "The account given here draws on several older sources.",
    "Some of the details are still debated by specialists.",
    "Further reading can be found in the regional archives.",
    "This summary was revised after readers pointed out errors in an earlier draft.",
    "Not every source agrees on the finer points, but the main facts are settled.",
    "Photographs from earlier decades show how little has changed.",
    "The information here has been checked against the original records.",
    "Visitors who want to learn more are welcome to ask at the local library.",
    "A fuller history would need a book of its own.",
    "The subject attracts a small but devoted circle of enthusiasts.",
    "Opinions differ on how much weight the older reports deserve.",
    "Few outsiders knew much about it until fairly recently.",
)


def _check_disjoint() -> None:
    """No name of this set is a name of the bundled synthetic set."""
    import synthetic_set as bench  # this folder, on sys.path when this file is run as a script

    theirs = {s.casefold() for pool in (bench._FIRST_NAMES, bench._SURNAMES, bench._TOWNS, bench._RIVERS,
                                        bench._MOUNTAINS) for s in pool}
    theirs |= {(s + e).casefold() for s in bench._STEMS for e in bench._ENDINGS}
    ours = {s.casefold() for pool in (_FIRST, _SURNAME, _CITY, _PLACE, *(k.bases for k in KINDS)) for s in pool}
    if shared := sorted(ours & theirs):
        raise SystemExit(f"names shared with synthetic_set.py: {shared}")


# ---------------------------------------------------------------------------------------------------
# Items


class Registry:
    """Values and names of one item, none a substring of another (case-insensitive)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def clash(self, forms: Sequence[str]) -> bool:
        return any(f.casefold() in s or s in f.casefold() for f in forms for s in self.seen)

    def add(self, forms: Sequence[str]) -> None:
        self.seen.extend(f.casefold() for f in forms)

    def draw(self, rng: random.Random, draw: Callable[[random.Random], Value]) -> Value:
        for _ in range(200):
            value = draw(rng)
            if not self.clash(value.forms):
                self.add(value.forms)
                return value
        raise _Redraw


class _Redraw(Exception):
    pass


@dataclass
class Entity:
    kind: Kind
    slots: dict[str, str]
    values: dict[str, Value] = field(default_factory=dict)

    @property
    def core(self) -> str:
        return self.kind.core.format(**self.slots)

    def fill(self, template: str, value: str = "") -> str:
        name = self.kind.article + self.core
        ref = self.kind.ref
        text = template.format(**self.slots, name=name, Name=_cap(name), ref=ref, Ref=_cap(ref), value=value)
        return _cap(text)


def _edits(word: str) -> list[str]:
    """Near-identical spellings: one vowel changed, or the last letter."""
    out = []
    for i in range(1, len(word)):
        if word[i] in "aeiou":
            out += [word[:i] + v + word[i + 1:] for v in "aeiou" if v != word[i]]
    last = "aeo" if word[-1] in "aeiou" else "dklmnrst"
    out += [word[:-1] + c for c in last if c != word[-1]]
    return out


def _fresh_entity(rng: random.Random, kind: Kind, reg: Registry, used_bases: set[str]) -> Entity:
    for _ in range(200):
        base = rng.choice(kind.bases)
        if base in used_bases:
            continue
        ent = Entity(kind, {"base": base, **{k: rng.choice(v) for k, v in kind.slots.items()}})
        if not reg.clash([ent.core, base]):
            reg.add([ent.core, base])
            used_bases.add(base)
            return ent
    raise _Redraw


def _look_alikes(rng: random.Random, target: Entity, n: int, reg: Registry) -> list[Entity]:
    """n entities of the target's kind whose names differ from it by a letter or one slot."""
    kind, out = target.kind, []
    candidates = [dict(target.slots, base=b) for b in _edits(target.slots["base"])]
    for slot in kind.alike:
        candidates += [dict(target.slots, **{slot: v}) for v in kind.slots[slot] if v != target.slots[slot]]
    rng.shuffle(candidates)
    for slots in candidates:
        if len(out) == n:
            break
        ent = Entity(kind, slots)
        if not reg.clash([ent.core]):
            reg.add([ent.core])
            out.append(ent)
    if len(out) < n:
        raise _Redraw
    return out


@dataclass
class Doc:
    entity: Entity
    title: str | None
    sentences: list[tuple[str, bool]]  # (sentence, is a filler)
    breaks: tuple[float, ...]  # paragraph cuts, as fractions of the sentences

    def text(self) -> str:
        sents = [s for s, _ in self.sentences]
        # Paragraphs of two sentences or more.
        cuts = sorted({min(max(round(b * len(sents)), 2), len(sents) - 2) for b in self.breaks})
        cuts = [c for j, c in enumerate(cuts) if c - ([0, *cuts][j]) >= 2] if len(sents) >= 6 else []
        paras, start = [], 0
        for c in [*cuts, len(sents)]:
            paras.append(" ".join(sents[start:c]))
            start = c
        return "\n\n".join(([self.title] if self.title else []) + paras)

    def words(self) -> int:
        return len(self.text().split())

    def drop_filler(self) -> bool:
        """Drop the last filler unless that would leave the document under MIN_WORDS."""
        for j in range(len(self.sentences) - 1, -1, -1):
            if self.sentences[j][1] and self.words() - len(self.sentences[j][0].split()) >= MIN_WORDS:
                del self.sentences[j]
                return True
        return False


def _write_doc(rng: random.Random, ent: Entity, words: int) -> Doc:
    kind = ent.kind
    facts = [(ent.fill(rng.choice(f.statements), ent.values[f.key].text), False) for f in kind.facts]
    rng.shuffle(facts)
    # A few generic sentences at most, so the documents of an item do not all read alike.
    pool = [ent.fill(s) for s in kind.fillers] + rng.sample(GENERIC_FILLERS, 4)
    rng.shuffle(pool)
    title = rng.choice([ent.core, f"{kind.label}: {ent.core}"]) if rng.random() < 0.35 else None
    opener = ent.fill(rng.choice(kind.openers))
    total = len(opener.split()) + sum(len(s.split()) for s, _ in facts) + (len(title.split()) if title else 0)
    fillers = []
    for s in pool:
        w = len(s.split())
        if total >= MIN_WORDS and (total + w / 2 > words or total + w > MAX_WORDS):
            break
        fillers.append((s, True))
        total += w
    # Facts anywhere among the fillers, in any order: not always in the lead as in the synthetic set.
    body = fillers[:]
    for fact in facts:
        body.insert(rng.randint(0, len(body)), fact)
    breaks = tuple(sorted(rng.random() for _ in range(rng.choice((0, 1, 1, 2)))))
    return Doc(ent, title, [(opener, False), *body], breaks)


def _question(rng: random.Random, ent: Entity, fact: Fact, style: str) -> str:
    if style == "direct":
        return ent.fill(fact.question)
    if style == "according":
        q = ent.fill(fact.question)
        return rng.choice(_ACCORDING) + q[:1].lower() + q[1:]
    if style == "command":
        return ent.fill(fact.command)
    return ent.fill(fact.terse)


@dataclass(frozen=True)
class Plan:
    kind: Kind
    fact: Fact
    layout: str
    k: int
    pos: int  # the answer's document
    style: str
    system: str | None


def plans(n: int, seed: int) -> list[Plan]:
    """Each attribute balanced over the set (kinds, facts, layouts, sizes, styles, systems, positions)."""
    rng = random.Random(f"multidoc_other:{seed}:plan")

    def spread(options: Sequence) -> list:
        out = [options[i % len(options)] for i in range(n)]
        rng.shuffle(out)
        return out

    kinds, layouts, sizes = spread(KINDS), spread(LAYOUTS), spread(range(MIN_DOCS, MAX_DOCS + 1))
    styles, systems = spread(STYLES), spread(SYSTEMS)
    # The answer's position: among the items with k documents, each of the k positions in turn.
    positions: dict[int, list[int]] = {}
    for k in sorted(set(sizes)):
        cycle = [p for _ in range(-(-sizes.count(k) // k)) for p in rng.sample(range(k), k)]
        positions[k] = cycle
    fact_turn: Counter[str] = Counter()
    out = []
    for i in range(n):
        kind = kinds[i]
        fact = kind.facts[fact_turn[kind.key] % len(kind.facts)]
        fact_turn[kind.key] += 1
        out.append(Plan(kind, fact, layouts[i], sizes[i], positions[sizes[i]].pop(0), styles[i], systems[i]))
    return out


def make_item(i: int, plan: Plan, seed: int, count_tokens: Callable[[str], int]) -> dict:
    rng = random.Random(f"multidoc_other:{seed}:{i}")
    for _ in range(200):
        try:
            item = _draw_item(rng, plan, count_tokens)
        except _Redraw:
            continue
        if _unambiguous(item):
            item["id"] = f"mdo{seed}-{i:03d}-{plan.layout}-{plan.kind.key}-{plan.fact.key}"
            return {key: item[key] for key in ("id", "system", "documents", "question", "answers", "answer_doc")
                    if item.get(key) is not None}
    raise RuntimeError(f"could not draw an unambiguous item {i}")


def _draw_item(rng: random.Random, plan: Plan, count_tokens: Callable[[str], int]) -> dict:
    reg, used = Registry(), set()
    k, pos = plan.k, plan.pos
    target = _fresh_entity(rng, plan.kind, reg, used)
    if plan.layout == "lookalike":
        n_alike = k - 1
    elif plan.layout == "pair":
        n_alike = rng.randint(1, min(2, k - 2))
    else:
        n_alike = 0
    others = _look_alikes(rng, target, n_alike, reg)
    for _ in range(k - 1 - n_alike):
        # Unrelated documents: mostly other kinds, now and then the same kind under a distinct name.
        kind = rng.choice(KINDS) if rng.random() < 1 / 3 else rng.choice([x for x in KINDS if x is not plan.kind])
        others.append(_fresh_entity(rng, kind, reg, used))
    rng.shuffle(others)
    entities = others[:pos] + [target] + others[pos:]
    for ent in entities:
        for f in ent.kind.facts:
            ent.values[f.key] = reg.draw(rng, f.draw)

    docs = [_write_doc(rng, ent, rng.randint(MIN_WORDS, MAX_WORDS)) for ent in entities]
    question = _question(rng, target, plan.fact, plan.style)

    def tokens() -> int:
        return count_tokens("\n\n".join(d.text() for d in docs) + "\n\n" + question)

    # Over the budget: drop fillers from the longest distractor first, then from the answer's document.
    while tokens() > TOKEN_BUDGET:
        order = sorted((j for j in range(k) if j != pos), key=lambda j: -docs[j].words()) + [pos]
        if not any(docs[j].drop_filler() for j in order):
            raise _Redraw
    return {
        "system": plan.system,
        "documents": [d.text() for d in docs],
        "question": question,
        "answers": list(target.values[plan.fact.key].forms),
        "answer_doc": pos,
        "_value": target.values[plan.fact.key].text,
        "_target": target.core,
    }


def _unambiguous(item: dict) -> bool:
    """Each answer form only in the answer's statement; the target's name in its document alone."""
    docs = [d.casefold() for d in item["documents"]]
    pos, forms = item["answer_doc"], [a.casefold() for a in item["answers"]]
    value, target = item.pop("_value").casefold(), item.pop("_target").casefold()
    if value not in docs[pos] or any(f in docs[pos].replace(value, "", 1) for f in forms):
        return False
    if any(f in item["question"].casefold() for f in forms):
        return False
    rest = [d for j, d in enumerate(docs) if j != pos]
    return not any(f in d for f in forms for d in rest) and not any(target in d for d in rest)


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


# ---------------------------------------------------------------------------------------------------
# Command line


def summarize(path: Path, tokenizer) -> str:
    from kvboost_rag.bench.data import load_items

    items = load_items(path)
    k = [len(it.documents) for it in items]
    words = [len(d.split()) for it in items for d in it.documents]
    toks = [len(tokenizer("\n\n".join(it.documents) + "\n\n" + it.question, add_special_tokens=False).input_ids)
            for it in items]
    chat = [len(tokenizer.apply_chat_template(
        ([{"role": "system", "content": it.system}] if it.system else [])
        + [{"role": "user", "content": "\n\n".join([*it.documents, it.question])}],
        tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]) for it in items]
    layout = Counter(it.id.split("-")[2] for it in items)
    kind = Counter(it.id.split("-")[3] for it in items)
    # (position + 0.5) / k: uniform on [0, 1) when every position of every k is equally likely.
    rel = [(it.answer_doc + 0.5) / len(it.documents) for it in items]
    thirds = Counter(int(r * 3) for r in rel)

    def mmm(xs: list[int]) -> str:
        return f"{min(xs)} / {statistics.mean(xs):.1f} / {max(xs)}"

    return "\n".join([
        f"{path}: {len(items)} items, {path.stat().st_size / 1024:.0f} KiB",
        f"docs per item min/mean/max: {mmm(k)}",
        f"words per doc min/mean/max: {mmm(words)}",
        f"tokens (docs joined by blank lines + question) min/mean/max: {mmm(toks)}",
        f"tokens (whole chat prompt) min/mean/max: {mmm(chat)}",
        f"look-alike share: {(layout['lookalike'] + layout['pair']) / len(items):.0%} "
        f"(layouts: {dict(sorted(layout.items()))})",
        f"kinds: {dict(sorted(kind.items()))}",
        f"answer position, first/middle/last third of the item: {thirds[0]} / {thirds[1]} / {thirds[2]} "
        f"(mean relative position {statistics.mean(rel):.2f}); "
        f"first doc {sum(it.answer_doc == 0 for it in items)}, "
        f"last doc {sum(it.answer_doc == len(it.documents) - 1 for it in items)}",
        f"no system text: {sum(it.system is None for it in items)} items",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=N_ITEMS)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from kvboost_rag.models import convert_bundled

    _check_disjoint()
    tokenizer = AutoTokenizer.from_pretrained(convert_bundled()[0])

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    items = [make_item(i, plan, args.seed, count_tokens) for i, plan in enumerate(plans(args.n, args.seed))]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    print(summarize(args.out, tokenizer), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
