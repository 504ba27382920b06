"""Workload ``json_calls``: JSON tool schemas and a user request whose answer is one JSON
call; scored by :func:`json_call_score` (tool name and arguments).
"""

from __future__ import annotations

import json
import math
import re
from typing import Callable, Sequence

from .common import TokenCounter, _finish_item, _rng


# ============================================================================ json_calls


_CITIES = ["Paris", "Tokyo", "Nairobi", "Lima", "Oslo", "Toronto", "Mumbai", "Sydney", "Berlin", "Cairo",
           "Seoul", "Madrid", "Denver", "Hanoi", "Lisbon", "Reykjavik", "Montreal", "Santiago", "Istanbul", "Dublin"]
_CURRENCIES = ["USD", "EUR", "JPY", "GBP", "CHF", "CAD", "AUD", "INR", "BRL", "KRW", "SEK", "MXN"]
_PEOPLE = ["Alice Moreau", "Bilal Haddad", "Chen Wei", "Dara O'Neill", "Emeka Obi", "Freya Lund", "Gita Rao",
           "Hugo Silva", "Ines Costa", "Jonas Berg", "Keiko Sato", "Luis Ortega"]
_LANGS = {"English": "en", "French": "fr", "German": "de", "Spanish": "es", "Italian": "it", "Japanese": "ja",
          "Chinese": "zh", "Portuguese": "pt"}
_PHRASES = ["Where is the train station?", "I would like a cup of tea.", "The meeting is postponed until Friday.",
            "Thank you for your help.", "Please close the window.", "How much does this cost?",
            "The museum opens at nine.", "My flight was cancelled."]
_TICKERS = ["AAPL", "MSFT", "NVDA", "TSLA", "AMZN", "GOOGL", "IBM", "ORCL", "SAP", "SONY"]
_TOPICS = ["technology", "sports", "science", "business", "health", "politics"]
_COUNTRIES = {"France": "FR", "Japan": "JP", "Kenya": "KE", "Peru": "PE", "Norway": "NO", "Canada": "CA",
              "India": "IN", "Brazil": "BR"}
_TZS = ["Europe/Paris", "Asia/Tokyo", "America/New_York", "Africa/Nairobi", "Australia/Sydney", "America/Lima"]
_ROOMS = ["kitchen", "living_room", "bedroom", "bathroom", "office", "garage"]
_SONGS = [("Clair de Lune", "Claude Debussy"), ("Bohemian Rhapsody", "Queen"), ("So What", "Miles Davis"),
          ("Hey Jude", "The Beatles"), ("Hallelujah", "Leonard Cohen"), ("Dancing Queen", "ABBA")]
_TASKS_TODO = ["renew the passport", "call the plumber", "submit the quarterly report", "buy a birthday gift",
               "book a dentist appointment", "water the plants"]
_PKGS = ["numpy", "requests", "left-pad", "serde", "express", "pandas", "tokio", "lodash"]


def _date(rng) -> str:
    return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _time(rng) -> str:
    return f"{rng.randint(7, 21):02d}:{rng.choice(['00', '15', '30', '45'])}"


def _S(desc, **kw):
    return {"type": "string", "description": desc, **kw}


def _I(desc, **kw):
    return {"type": "integer", "description": desc, **kw}


def _N(desc, **kw):
    return {"type": "number", "description": desc, **kw}


def _B(desc, **kw):
    return {"type": "boolean", "description": desc, **kw}


def _tool(name, desc, props, required):
    return {"name": name, "description": desc,
            "parameters": {"type": "object", "properties": props, "required": required}}


def _g_weather(rng):
    city = rng.choice(_CITIES)
    if rng.random() < 0.5:
        unit = rng.choice(["celsius", "fahrenheit"])
        return {"location": city, "unit": unit}, f"What's the weather like in {city} right now? Give me the temperature in {unit}."
    return {"location": city}, f"Is it raining in {city} at the moment?"


def _g_currency(rng):
    a, b = rng.sample(_CURRENCIES, 2)
    amt = rng.choice([25, 120, 999.5, 1500, 42.75, 10000])
    return {"amount": amt, "from_currency": a, "to_currency": b}, f"How much is {amt} {a} in {b}?"


def _g_flight(rng):
    o, d = rng.sample(_CITIES, 2)
    date = _date(rng)
    args = {"origin": o, "destination": d, "date": date}
    req = f"Book me a flight from {o} to {d} on {date}"
    if rng.random() < 0.5:
        p = rng.randint(2, 5)
        args["passengers"] = p
        req += f" for {p} passengers"
    if rng.random() < 0.5:
        c = rng.choice(["premium_economy", "business", "first"])
        args["cabin"] = c
        req += f", {c.replace('_', ' ')} class"
    return args, req + "."


def _g_timer(rng):
    m = rng.choice([3, 5, 10, 12, 25, 45, 90])
    if rng.random() < 0.5:
        lab = rng.choice(["pasta", "laundry", "tea", "workout", "bread"])
        return {"minutes": m, "label": lab}, f"Set a {m} minute timer called \"{lab}\"."
    return {"minutes": m}, f"Start a timer for {m} minutes, please."


def _g_email(rng):
    who = rng.choice(_PEOPLE)
    addr = who.lower().replace(" ", ".").replace("'", "") + "@example.com"
    subj = rng.choice(["Quarterly numbers", "Lunch on Thursday", "Draft contract", "Travel plans"])
    body = rng.choice(["Please see the attached file.", "Are you free at noon?", "Let me know what you think.",
                       "I will be late tomorrow."])
    return ({"to": addr, "subject": subj, "body": body},
            f"Send an email to {addr} with the subject \"{subj}\" and the text \"{body}\"")


def _g_search(rng):
    qq = rng.choice(["history of the printing press", "best hiking trails in Patagonia", "how do vaccines work",
                     "python asyncio tutorial", "recipes with lentils"])
    if rng.random() < 0.5:
        k = rng.choice([3, 10, 20])
        return {"query": qq, "max_results": k}, f"Search the web for \"{qq}\" and show me the top {k} results."
    return {"query": qq}, f"Look up \"{qq}\" on the web."


def _g_event(rng):
    title = rng.choice(["Team sync", "Dentist", "Project review", "Yoga class", "Parent-teacher meeting"])
    date, t, dur = _date(rng), _time(rng), rng.choice([30, 45, 60, 90])
    return ({"title": title, "date": date, "start_time": t, "duration_minutes": dur},
            f"Put \"{title}\" in my calendar on {date} at {t} for {dur} minutes.")


def _g_translate(rng):
    lang = rng.choice(sorted(_LANGS))
    text = rng.choice(_PHRASES)
    return {"text": text, "target_language": _LANGS[lang]}, f"Translate \"{text}\" into {lang}."


def _g_stock(rng):
    t = rng.choice(_TICKERS)
    return {"ticker": t}, f"What is the current share price of {t}?"


def _g_tip(rng):
    bill = rng.choice([48.6, 120, 75.25, 33, 210.4])
    pct = rng.choice([10, 15, 18, 20, 22])
    return {"bill_amount": bill, "tip_percent": pct}, f"Our bill is {bill}. How much is a {pct}% tip?"


def _g_restaurants(rng):
    city = rng.choice(_CITIES)
    cuisine = rng.choice(["italian", "japanese", "mexican", "indian", "vegan", "ethiopian"])
    args = {"city": city, "cuisine": cuisine}
    req = f"Find {cuisine} restaurants in {city}"
    if rng.random() < 0.5:
        lvl = rng.randint(1, 4)
        args["max_price_level"] = lvl
        req += f" with a price level of at most {lvl}"
    return args, req + "."


def _g_music(rng):
    song, artist = rng.choice(_SONGS)
    if rng.random() < 0.5:
        return {"song": song, "artist": artist}, f"Play \"{song}\" by {artist}."
    return {"song": song}, f"Put on the song \"{song}\"."


def _g_lights(rng):
    room = rng.choice(_ROOMS)
    if rng.random() < 0.5:
        br = rng.choice([10, 30, 50, 75, 100])
        return {"room": room, "brightness": br}, f"Turn on the {room.replace('_', ' ')} lights at {br}% brightness."
    return {"room": room}, f"Switch on the lights in the {room.replace('_', ' ')}."


def _g_thermostat(rng):
    if rng.random() < 0.5:
        t = rng.choice([19, 20.5, 21, 22, 23.5])
        return {"temperature": t, "unit": "celsius"}, f"Set the thermostat to {t} degrees celsius."
    t = rng.choice([64, 68, 70, 72, 75])
    return {"temperature": t, "unit": "fahrenheit"}, f"Set the heating to {t} degrees fahrenheit."


def _g_directions(rng):
    o, d = rng.sample(["the central station", "the airport", "the city museum", "the harbour", "the university",
                       "the old town square"], 2)
    mode = rng.choice(["driving", "walking", "transit", "cycling"])
    verb = {"driving": "drive", "walking": "walk", "transit": "take public transit", "cycling": "cycle"}[mode]
    return {"origin": o, "destination": d, "mode": mode}, f"How do I {verb} from {o} to {d}?"


def _g_todo(rng):
    task = rng.choice(_TASKS_TODO)
    due = _date(rng)
    args = {"task": task, "due_date": due}
    req = f"Add \"{task}\" to my to-do list, due {due}"
    if rng.random() < 0.6:
        pr = rng.choice(["low", "high"])
        args["priority"] = pr
        req += f", {pr} priority"
    return args, req + "."


def _g_word(rng):
    w = rng.choice(["serendipity", "ephemeral", "quixotic", "ubiquitous", "sonder", "petrichor"])
    return {"word": w}, f"What does the word \"{w}\" mean?"


def _g_time(rng):
    tz = rng.choice(_TZS)
    return {"timezone": tz}, f"What time is it now in the {tz} time zone?"


def _g_pizza(rng):
    size = rng.choice(["small", "medium", "large"])
    tops = rng.sample(["mushrooms", "olives", "basil", "pepperoni", "onions", "peppers"], rng.randint(1, 3))
    deliv = rng.random() < 0.5
    how = "delivered to my home" if deliv else "for pickup"
    return ({"size": size, "toppings": tops, "delivery": deliv},
            f"Order a {size} pizza with {', '.join(tops)}, {how}.")


def _g_bmi(rng):
    w, h = rng.choice([58, 64.5, 72, 80, 95]), rng.choice([160, 168, 175, 182, 190])
    return {"weight_kg": w, "height_cm": h}, f"Compute the BMI of someone who weighs {w} kg and is {h} cm tall."


def _g_table(rng):
    r = rng.choice(["Chez Marie", "The Blue Door", "Sakura House", "La Trattoria", "Spice Route"])
    date, t, p = _date(rng), _time(rng), rng.randint(2, 8)
    return ({"restaurant": r, "date": date, "time": t, "party_size": p},
            f"Reserve a table for {p} at {r} on {date} at {t}.")


def _g_news(rng):
    topic = rng.choice(_TOPICS)
    country = rng.choice(sorted(_COUNTRIES))
    return {"topic": topic, "country": _COUNTRIES[country]}, f"Show me the latest {topic} news from {country}."


def _g_units(rng):
    v, a, b = rng.choice([(5, "miles", "kilometers"), (12, "inches", "centimeters"), (3.5, "liters", "gallons"),
                          (150, "pounds", "kilograms"), (2, "hours", "seconds")])
    return {"value": v, "from_unit": a, "to_unit": b}, f"Convert {v} {a} to {b}."


def _g_files(rng):
    d = rng.choice(["/home/me/projects", "/var/log", "/data/reports", "/srv/www"])
    pat = rng.choice(["*.py", "*.log", "*.csv", "*.md"])
    if rng.random() < 0.5:
        return {"directory": d, "pattern": pat, "recursive": True}, f"Find all {pat} files in {d} and its subfolders."
    return {"directory": d, "pattern": pat}, f"List the {pat} files in {d}."


def _g_sql(rng):
    db = rng.choice(["sales", "inventory", "hr"])
    q = rng.choice(["SELECT COUNT(*) FROM orders", "SELECT name FROM employees WHERE age > 40",
                    "SELECT SUM(amount) FROM invoices"])
    return {"database": db, "query": q}, f"Run the query `{q}` on the {db} database."


def _g_pkg(rng):
    pkg = rng.choice(_PKGS)
    reg = {"numpy": "pypi", "requests": "pypi", "pandas": "pypi", "left-pad": "npm", "express": "npm",
           "lodash": "npm", "serde": "crates", "tokio": "crates"}[pkg]
    name = {"pypi": "PyPI", "npm": "npm", "crates": "crates.io"}[reg]
    return {"package_name": pkg, "registry": reg}, f"What is the latest version of {pkg} on {name}?"


def _g_reminder(rng):
    msg = rng.choice(["take the medication", "call mom", "move the car", "join the webinar"])
    dt = f"{_date(rng)}T{_time(rng)}:00"
    return {"message": msg, "datetime": dt}, f"Remind me to {msg} at {dt}."


def _g_flight_status(rng):
    fl = rng.choice(["LH", "AF", "BA", "JL", "QF"]) + str(rng.randint(100, 999))
    return {"flight_number": fl}, f"Is flight {fl} on time?"


def _g_resize(rng):
    p = rng.choice(["photos/beach.jpg", "img/logo.png", "scans/page1.tiff"])
    w, h = rng.choice([(800, 600), (1024, 768), (256, 256), (1920, 1080)])
    return {"path": p, "width": w, "height": h}, f"Resize {p} to {w} by {h} pixels."


def _g_population(rng):
    c = rng.choice(sorted(_COUNTRIES))
    y = rng.choice([1950, 1990, 2000, 2020])
    return {"country": c, "year": y}, f"What was the population of {c} in {y}?"


_TOOLS: list[tuple[dict, Callable]] = [
    (_tool("get_weather", "Get the current weather for a location.",
           {"location": _S("City name, e.g. 'Paris'"),
            "unit": _S("Temperature unit", enum=["celsius", "fahrenheit"], default="celsius")}, ["location"]), _g_weather),
    (_tool("convert_currency", "Convert an amount of money from one currency to another.",
           {"amount": _N("Amount to convert"), "from_currency": _S("ISO 4217 code of the source currency"),
            "to_currency": _S("ISO 4217 code of the target currency")}, ["amount", "from_currency", "to_currency"]), _g_currency),
    (_tool("book_flight", "Book a one-way flight.",
           {"origin": _S("Departure city"), "destination": _S("Arrival city"), "date": _S("Date, YYYY-MM-DD"),
            "passengers": _I("Number of passengers", default=1),
            "cabin": _S("Cabin class", enum=["economy", "premium_economy", "business", "first"], default="economy")},
           ["origin", "destination", "date"]), _g_flight),
    (_tool("set_timer", "Start a countdown timer.",
           {"minutes": _I("Duration in minutes"), "label": _S("Optional name of the timer")}, ["minutes"]), _g_timer),
    (_tool("send_email", "Send an email.",
           {"to": _S("Recipient email address"), "subject": _S("Subject line"), "body": _S("Message text")},
           ["to", "subject", "body"]), _g_email),
    (_tool("search_web", "Search the web and return result snippets.",
           {"query": _S("Search query"), "max_results": _I("How many results to return", default=5)}, ["query"]), _g_search),
    (_tool("create_calendar_event", "Create an event in the user's calendar.",
           {"title": _S("Event title"), "date": _S("Date, YYYY-MM-DD"), "start_time": _S("Start time, HH:MM (24h)"),
            "duration_minutes": _I("Length of the event in minutes")}, ["title", "date", "start_time", "duration_minutes"]), _g_event),
    (_tool("translate_text", "Translate text into another language.",
           {"text": _S("Text to translate"),
            "target_language": _S("ISO 639-1 code of the target language", enum=sorted(_LANGS.values()))},
           ["text", "target_language"]), _g_translate),
    (_tool("get_stock_price", "Get the latest price of a stock.", {"ticker": _S("Stock ticker symbol")}, ["ticker"]), _g_stock),
    (_tool("calculate_tip", "Calculate the tip for a restaurant bill.",
           {"bill_amount": _N("Total of the bill"), "tip_percent": _N("Tip percentage, e.g. 15")},
           ["bill_amount", "tip_percent"]), _g_tip),
    (_tool("find_restaurants", "Find restaurants in a city.",
           {"city": _S("City name"), "cuisine": _S("Kind of food", enum=["italian", "japanese", "mexican", "indian", "vegan", "ethiopian"]),
            "max_price_level": _I("Highest price level, 1 (cheap) to 4 (expensive)", minimum=1, maximum=4)},
           ["city", "cuisine"]), _g_restaurants),
    (_tool("play_music", "Play a song on the user's speakers.",
           {"song": _S("Song title"), "artist": _S("Artist name")}, ["song"]), _g_music),
    (_tool("turn_on_lights", "Turn on the smart lights of a room.",
           {"room": _S("Room", enum=_ROOMS), "brightness": _I("Brightness in percent", minimum=0, maximum=100, default=100)},
           ["room"]), _g_lights),
    (_tool("set_thermostat", "Set the target temperature of the thermostat.",
           {"temperature": _N("Target temperature"), "unit": _S("Unit", enum=["celsius", "fahrenheit"])},
           ["temperature", "unit"]), _g_thermostat),
    (_tool("get_directions", "Get directions between two places.",
           {"origin": _S("Start"), "destination": _S("Goal"), "mode": _S("Travel mode", enum=["driving", "walking", "transit", "cycling"])},
           ["origin", "destination", "mode"]), _g_directions),
    (_tool("create_todo", "Add an item to the to-do list.",
           {"task": _S("What to do"), "due_date": _S("Due date, YYYY-MM-DD"),
            "priority": _S("Priority", enum=["low", "medium", "high"], default="medium")}, ["task", "due_date"]), _g_todo),
    (_tool("lookup_word", "Look up the definition of an English word.", {"word": _S("The word")}, ["word"]), _g_word),
    (_tool("get_time_in_timezone", "Get the current local time in a time zone.",
           {"timezone": _S("IANA time zone name, e.g. Europe/Paris")}, ["timezone"]), _g_time),
    (_tool("order_pizza", "Order a pizza.",
           {"size": _S("Pizza size", enum=["small", "medium", "large"]),
            "toppings": {"type": "array", "items": {"type": "string"}, "description": "Toppings"},
            "delivery": _B("Deliver (true) or pick up (false)")}, ["size", "toppings", "delivery"]), _g_pizza),
    (_tool("compute_bmi", "Compute the body mass index.",
           {"weight_kg": _N("Weight in kilograms"), "height_cm": _N("Height in centimeters")}, ["weight_kg", "height_cm"]), _g_bmi),
    (_tool("reserve_table", "Reserve a table at a restaurant.",
           {"restaurant": _S("Restaurant name"), "date": _S("Date, YYYY-MM-DD"), "time": _S("Time, HH:MM (24h)"),
            "party_size": _I("Number of guests")}, ["restaurant", "date", "time", "party_size"]), _g_table),
    (_tool("get_news", "Get the latest news headlines.",
           {"topic": _S("Topic", enum=_TOPICS), "country": _S("ISO 3166-1 alpha-2 country code")}, ["topic", "country"]), _g_news),
    (_tool("convert_units", "Convert a value between units of measurement.",
           {"value": _N("Value to convert"), "from_unit": _S("Unit of the value"), "to_unit": _S("Unit to convert to")},
           ["value", "from_unit", "to_unit"]), _g_units),
    (_tool("search_files", "Find files matching a glob pattern.",
           {"directory": _S("Directory to search"), "pattern": _S("Glob pattern, e.g. *.txt"),
            "recursive": _B("Also search subdirectories", default=False)}, ["directory", "pattern"]), _g_files),
    (_tool("run_sql_query", "Run a read-only SQL query.",
           {"database": _S("Database name", enum=["sales", "inventory", "hr"]), "query": _S("SQL query")},
           ["database", "query"]), _g_sql),
    (_tool("get_package_info", "Get information about a software package.",
           {"package_name": _S("Package name"), "registry": _S("Package registry", enum=["pypi", "npm", "crates"])},
           ["package_name", "registry"]), _g_pkg),
    (_tool("schedule_reminder", "Schedule a reminder notification.",
           {"message": _S("Reminder text"), "datetime": _S("When, ISO 8601 YYYY-MM-DDTHH:MM:SS")}, ["message", "datetime"]), _g_reminder),
    (_tool("check_flight_status", "Check the status of a flight.", {"flight_number": _S("Flight number, e.g. LH123")},
           ["flight_number"]), _g_flight_status),
    (_tool("resize_image", "Resize an image file.",
           {"path": _S("Image path"), "width": _I("New width in pixels"), "height": _I("New height in pixels")},
           ["path", "width", "height"]), _g_resize),
    (_tool("get_population", "Get the population of a country in a given year.",
           {"country": _S("Country name"), "year": _I("Year")}, ["country", "year"]), _g_population),
]

_JSON_INTRO = "You are a function-calling assistant. You can use the following tools, described as JSON schemas:\n"
_JSON_RULES = (
    "\nTo use a tool, reply with exactly one JSON object of the form "
    '{"name": <tool name>, "arguments": {<argument>: <value>, ...}} and nothing else. '
    "Include every required argument; include optional arguments only if the request gives them.\n\n"
)


def _build_json_calls(counter: TokenCounter, max_tokens: int, n: int | None, seed: int, *,
                      tool_counts: Sequence[int] = (4, 8, 16, 30)) -> tuple[list[dict], dict]:
    tool_counts = [int(c) for c in tool_counts]
    if any(not (1 <= c <= len(_TOOLS)) for c in tool_counts):
        raise ValueError(f"tool_counts must be in [1, {len(_TOOLS)}], got {tool_counts}")
    n = 2 * len(_TOOLS) if n is None else n
    items = [_json_item(i, seed, tool_counts[i % len(tool_counts)], max_tokens, counter) for i in range(n)]
    return items, {"tool_counts": tool_counts, "library_size": len(_TOOLS), "generator": "synthetic tool library"}


def _json_item(i: int, seed: int, n_tools: int, max_tokens: int, counter: TokenCounter) -> dict:
    rng = _rng("json_calls", seed, i)
    ti = i % len(_TOOLS) if i < 2 * len(_TOOLS) else rng.randrange(len(_TOOLS))  # every tool is a target
    schema, gen = _TOOLS[ti]
    args, request = gen(rng)
    others = [j for j in range(len(_TOOLS)) if j != ti]
    chosen = rng.sample(others, n_tools - 1) + [ti]
    rng.shuffle(chosen)
    question = "User request: " + request
    while True:
        tools = [_TOOLS[j][0] for j in chosen]
        prompt = _JSON_INTRO + json.dumps(tools, indent=1) + _JSON_RULES + question
        nt = counter.count(prompt)
        if nt <= max_tokens:
            break
        if len(chosen) == 1:
            raise ValueError(f"json_calls: max_tokens {max_tokens} is too small for one tool ({nt} tokens)")
        chosen.remove(next(j for j in chosen if j != ti))
    call = {"name": schema["name"], "arguments": args}
    source = {"generator": "sglang_vc.bench.workloads synthetic tool library", "tools": [t["name"] for t in tools],
              "target_tool": schema["name"]}
    return _finish_item("json_calls", i, "json_call", prompt, question, json.dumps(call), nt, None, 96, source,
                        call=call, tools=tools)


def extract_json_call(text: str) -> dict | None:
    """The first JSON object in ``text`` that looks like a tool call, normalised to
    ``{"name": str, "arguments": dict}`` (accepts ``parameters`` for ``arguments``, an
    OpenAI-style ``{"function": {...}}`` wrapper and arguments given as a JSON string)."""
    dec = json.JSONDecoder()
    for m in re.finditer(r"\{", text or ""):
        try:
            obj, _ = dec.raw_decode(text, m.start())
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if "function" in obj and isinstance(obj["function"], dict):
            obj = obj["function"]
        if not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                continue
        if not isinstance(args, dict):
            continue
        return {"name": obj["name"], "arguments": args}
    return None


def _same_value(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(b, str) and str(a).lower() == b.strip().lower())
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(a, (int, float)) and isinstance(b, str):
        try:
            return math.isclose(float(a), float(b.strip()), rel_tol=1e-9, abs_tol=1e-9)
        except ValueError:
            return False
    if isinstance(a, str) and isinstance(b, str):
        return a.strip().rstrip(".").casefold() == b.strip().rstrip(".").casefold()
    if isinstance(a, list) and isinstance(b, list):
        return sorted(map(str, a)) == sorted(map(str, b)) if len(a) == len(b) else False
    return a == b


def json_call_score(answer_text: str, item: dict) -> dict:
    """Parse the model's call and compare it with the expected one.

    Returns ``{"parsed", "name_ok", "args_ok", "score", "call"}``: ``args_ok`` requires every
    expected argument with an equal value (numbers by value, strings case-insensitively,
    lists as multisets) and no other argument unless it equals the schema's default.
    ``score`` is 1.0 for name and arguments right, 0.5 for the name only, else 0.0.
    """
    expected = item.get("call") or json.loads(item["answer"])
    call = extract_json_call(answer_text)
    if call is None:
        return {"parsed": False, "name_ok": False, "args_ok": False, "score": 0.0, "call": None}
    name_ok = call["name"] == expected["name"]
    args_ok = False
    if name_ok:
        props = {}
        for t in item.get("tools") or [s for s, _ in _TOOLS]:
            if t["name"] == expected["name"]:
                props = t["parameters"]["properties"]
        got, exp = call["arguments"], expected["arguments"]
        args_ok = all(k in got and _same_value(v, got[k]) for k, v in exp.items())
        for k, v in got.items():
            if k not in exp and not ("default" in props.get(k, {}) and _same_value(props[k]["default"], v)):
                args_ok = False
    return {"parsed": True, "name_ok": name_ok, "args_ok": args_ok,
            "score": 1.0 if name_ok and args_ok else 0.5 if name_ok else 0.0, "call": call}
