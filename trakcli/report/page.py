"""The style and script of the report page (:func:`trakcli.report.render_report`), inlined into every page.

The script reads the embedded JSON (its layout: :mod:`trakcli.report.html`) and draws the list of targets
(one page of 100 at a time) and the selected target; text reaches the page through ``textContent`` only.
The colours are those of :mod:`trakcli.plots` (proponents green, opponents red, the target blue).
"""

STYLE = r"""
:root { --pro: #1a7f37; --opp: #c62828; --pro-fill: #e8f5e9; --opp-fill: #fdecea; --target: #1f4e9a;
  --ink: #1d232a; --muted: #66707a; --line: #d9dee3; --bg: #f6f7f9; --sel: #dbe7f7; }
* { box-sizing: border-box; }
html, body { margin: 0; height: 100%; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: var(--ink);
  background: var(--bg); display: flex; flex-direction: column; }
header.top { padding: 10px 18px; background: #fff; border-bottom: 1px solid var(--line); }
header.top h1 { margin: 0; font-size: 18px; font-weight: 600; }
header.top .about { margin: 2px 0 0; color: var(--muted); font-size: 13px; }
header.top .about.scale { font-size: 12px; max-width: 110ch; }
#app { flex: 1; min-height: 0; display: flex; }
#side { width: 300px; flex: none; display: flex; flex-direction: column; background: #fff;
  border-right: 1px solid var(--line); min-height: 0; }
#search { margin: 10px 10px 4px; padding: 6px 8px; font: inherit; border: 1px solid var(--line); border-radius: 6px; }
#search:focus { outline: 2px solid var(--target); outline-offset: -1px; }
#count { padding: 0 12px 6px; color: var(--muted); font-size: 12px; }
#list { list-style: none; margin: 0; padding: 0; overflow-y: auto; flex: 1; min-height: 0; border-top: 1px solid var(--line); }
#list li { display: flex; align-items: center; gap: 8px; padding: 5px 12px; cursor: pointer; border-bottom: 1px solid #eef0f2;
  white-space: nowrap; overflow: hidden; }
#list li:hover { background: #f0f3f6; }
#list li.sel { background: var(--sel); box-shadow: inset 3px 0 0 var(--target); }
#list .idx { font-variant-numeric: tabular-nums; color: var(--target); font-weight: 600; min-width: 3.2em; }
#list .lab { color: var(--muted); font-size: 12px; }
#list .snip { overflow: hidden; text-overflow: ellipsis; color: #39424b; }
#pager { display: flex; align-items: center; justify-content: space-between; padding: 6px 10px;
  border-top: 1px solid var(--line); color: var(--muted); font-size: 12px; }
button { font: inherit; border: 1px solid var(--line); background: #fff; border-radius: 6px; padding: 2px 10px; cursor: pointer; }
button:hover:not(:disabled) { background: #eef2f6; }
button:disabled { opacity: .4; cursor: default; }
.keys { margin: 0; padding: 4px 12px 10px; color: var(--muted); font-size: 11px; }
kbd { font: 11px ui-monospace, monospace; border: 1px solid var(--line); border-bottom-width: 2px; border-radius: 3px; padding: 0 3px; background: #fafbfc; }
#detail { flex: 1; overflow-y: auto; padding: 16px 20px 40px; min-width: 0; }
.qhead { display: flex; align-items: center; gap: 12px; margin-bottom: 10px; }
.qhead h2 { margin: 0; font-size: 18px; color: var(--target); }
.qhead .where { color: var(--muted); font-size: 12px; margin-left: auto; }
.badge { display: inline-block; font-size: 12px; font-weight: 500; padding: 1px 7px; border-radius: 10px; background: #e9eef5; color: #38475a; margin-left: 6px; vertical-align: 2px; }
.query { background: #fff; border: 1px solid var(--line); border-left: 4px solid var(--target); border-radius: 8px; padding: 12px 14px; margin-bottom: 14px; }
.query .qbody { display: flex; gap: 16px; align-items: flex-start; }
.query .qtext { font-size: 15px; white-space: pre-wrap; overflow-wrap: anywhere; flex: 1; }
.facts { color: var(--muted); font-size: 12.5px; line-height: 1.6; }
.query > .facts { display: flex; gap: 16px; flex-wrap: wrap; margin-top: 6px; }
.shade-note { margin: 8px 0 0; color: var(--muted); font-size: 12px; }
.shade-note button { font-size: 12px; padding: 0 6px; margin-left: 6px; }
.sides { display: grid; grid-template-columns: repeat(auto-fit, minmax(440px, 1fr)); gap: 14px; align-items: start; }
.side { border-radius: 8px; padding: 10px 12px 12px; }
.side.pro { background: var(--pro-fill); }
.side.opp { background: var(--opp-fill); }
.side h3 { margin: 0 0 8px; font-size: 14px; }
.side.pro h3 { color: var(--pro); }
.side.opp h3 { color: var(--opp); }
.cards { display: flex; flex-direction: column; gap: 8px; }
.cards.pics { flex-direction: row; flex-wrap: wrap; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 7px 9px; }
.pro .card { border-left: 3px solid var(--pro); }
.opp .card { border-left: 3px solid var(--opp); }
.cards.pics .card { border-left-width: 1px; padding: 5px; text-align: center; }
.card.pickable { cursor: pointer; }
.card.pickable:hover { box-shadow: 0 1px 4px rgba(0,0,0,.15); }
.card.picked { outline: 2px solid var(--target); }
.cap { display: flex; align-items: baseline; gap: 7px; font-size: 12.5px; color: var(--muted); flex-wrap: wrap; }
.cards.pics .card { width: 124px; }
.sides.pics { grid-template-columns: 1fr; }
.cards.pics .cap { flex-direction: column; align-items: center; gap: 0; line-height: 1.3; }
.cards.pics .who { display: flex; gap: 4px; white-space: nowrap; }
.cap .idx { color: var(--ink); font-weight: 600; font-variant-numeric: tabular-nums; }
.cap .score { font-variant-numeric: tabular-nums; font-weight: 600; }
.cap .score.pos { color: var(--pro); }
.cap .score.neg { color: var(--opp); }
.bar { display: inline-block; height: 6px; border-radius: 3px; align-self: center; min-width: 1px; }
.pro .bar { background: var(--pro); }
.opp .bar { background: var(--opp); }
.doc-text { margin-top: 4px; white-space: pre-wrap; overflow-wrap: anywhere; }
.doc-text.clamped { max-height: 8.8em; overflow: hidden; -webkit-mask-image: linear-gradient(180deg, #000 70%, transparent); mask-image: linear-gradient(180deg, #000 70%, transparent); }
.more { margin-top: 4px; font-size: 12px; padding: 0 8px; }
canvas.pic { image-rendering: pixelated; image-rendering: crisp-edges; display: block; margin: 4px auto 0; border: 2px solid #888; background: #000; }
.pro canvas.pic { border-color: var(--pro); }
.opp canvas.pic { border-color: var(--opp); }
.query canvas.pic { border-color: var(--target); margin: 0; }
#list canvas.pic { border-width: 1px; margin: 0; flex: none; }
.tok { border-radius: 3px; }
.tok[data-cont] { border-top-left-radius: 0; border-bottom-left-radius: 0; box-shadow: inset 1px 0 rgba(255,255,255,.85); }
.tok[data-cont].tx, .tok[data-cont].tz { box-shadow: none; }
.tok.tx { color: #9aa3ab; }
.tok.strong { color: #fff; }
.tok.empty { color: #9aa3ab; }
.tok:hover { outline: 1px solid #555; }
.legend { display: inline-flex; gap: 14px; align-items: center; flex-wrap: wrap; }
.legend i { display: inline-block; width: 12px; height: 12px; border-radius: 3px; vertical-align: -2px; margin-right: 3px; }
.empty-state { color: var(--muted); padding: 40px; text-align: center; }
"""

SCRIPT = r"""
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("report-data").textContent);
  const Q = DATA.queries, DOCS = DATA.docs, IMG = DATA.image;
  const PAGE = 100;  // targets per page of the list
  const $ = (id) => document.getElementById(id);
  const search = $("search"), list = $("list"), detail = $("detail"), count = $("count");
  const SIDE = {p: {name: "Proponents", cls: "pro", what: "highest scores", none: "no train example has a positive score"},
                o: {name: "Opponents", cls: "opp", what: "lowest scores", none: "no train example has a negative score"}};
  let shown = Q.map((_, i) => i);  // positions in Q that pass the filter
  let cur = 0;                     // the selected position in `shown`
  let page = 0;                    // the list's page
  let picked = null;               // {key, rank}: the document whose contributions shade the target

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text != null) e.textContent = text;
    return e;
  }
  function fmt(v) {
    if (v == null) return "n/a";
    const s = String(Number(v.toPrecision(3)));
    return v > 0 ? "+" + s : s;
  }
  function picture(b64, size) {
    const [C, H, W] = IMG.shape;
    const c = el("canvas", "pic");
    c.width = W; c.height = H;
    c.style.width = size + "px"; c.style.height = Math.round(size * H / W) + "px";
    const bin = atob(b64), n = H * W, ctx = c.getContext("2d"), im = ctx.createImageData(W, H);
    for (let i = 0; i < n; i++) {
      const r = bin.charCodeAt(i);
      im.data[4 * i] = r;
      im.data[4 * i + 1] = C === 3 ? bin.charCodeAt(n + i) : r;
      im.data[4 * i + 2] = C === 3 ? bin.charCodeAt(2 * n + i) : r;
      im.data[4 * i + 3] = 255;
    }
    ctx.putImageData(im, 0, 0);
    return c;
  }
  // tokens shaded by their contributions: green positive, red negative, the intensity scaled to the
  // sequence's largest absolute contribution; null (not a target of the loss) grey. The texts are joined
  // as they are (each token's piece of the decoded text): the pieces of one word touch, with no gap, and
  // a token that continues a word gets a thin left edge; a tokenizer's own space marks (U+2581, U+0120
  // "Ġ") read as spaces.
  function tokens(texts, values) {
    const box = el("div", "doc-text toks");
    let max = 0;
    for (const v of values) if (v != null) max = Math.max(max, Math.abs(v));
    let joined = true;  // the text so far ends inside a word
    texts.forEach((t, i) => {
      const text = t.replace(/\u2581/g, " ").replace(/^\u0120/, " ").replace(/\n/g, "\u21b5\n");
      const m = /^(\s*)([\s\S]*?)(\s*)$/.exec(text);
      const core = m[2] || text;  // white space around a word stays outside its shading
      if (m[2] && m[1] && i) box.appendChild(document.createTextNode(m[1]));
      const s = el("span", "tok", core === "" ? "\u00b7" : core);
      if (i && m[2] && !m[1] && joined) s.dataset.cont = "";
      joined = !!m[2] && !m[3];
      if (core === "") s.classList.add("empty");
      const v = values[i];
      if (v == null) {
        s.classList.add("tx");
        s.title = JSON.stringify(t) + ": not a target of the loss";
      } else {
        const a = max > 0 ? Math.abs(v) / max : 0;
        s.classList.add(v > 0 ? "tp" : v < 0 ? "tn" : "tz");
        if (v !== 0) {
          s.style.backgroundColor = (v > 0 ? "rgba(26,127,55," : "rgba(198,40,40,") + (0.06 + 0.74 * a).toFixed(3) + ")";
          if (a > 0.55) s.classList.add("strong");
        }
        s.dataset.v = String(v);
        s.title = JSON.stringify(t) + ": " + fmt(v);
      }
      box.appendChild(s);
      if (m[2] && m[3]) box.appendChild(document.createTextNode(m[3]));
    });
    return box;
  }
  function clamp(box, card) {
    // long documents are cut to a few lines until "more" is clicked
    requestAnimationFrame(() => {
      box.classList.add("clamped");
      if (box.scrollHeight <= box.clientHeight + 2) { box.classList.remove("clamped"); return; }
      const b = el("button", "more", "more");
      b.type = "button";
      b.addEventListener("click", (ev) => {
        ev.stopPropagation();
        const open = box.classList.toggle("clamped");
        b.textContent = open ? "more" : "less";
      });
      card.appendChild(b);
    });
  }
  // what shades the target's tokens: one picked document's contributions, else the sum over the proponents
  function shading(q) {
    if (!q.tok) return null;
    if (picked && q[picked.key][picked.rank] && q[picked.key][picked.rank].tc) {
      const e = q[picked.key][picked.rank];
      return {texts: e.tt || q.tok, values: e.tc,
              note: SIDE[picked.key].name.slice(0, -1).toLowerCase() + " #" + e.d + "'s contributions (score " + fmt(e.s) + ")"};
    }
    const withTokens = q.p.filter((e) => e.tc && !e.tt);
    if (!withTokens.length) return null;
    const values = q.tok.map((_, i) => {
      let sum = null;
      for (const e of withTokens) if (e.tc[i] != null) sum = (sum || 0) + e.tc[i];
      return sum;
    });
    return {texts: q.tok, values: values, note: "the sum of the " + withTokens.length + " proponents' contributions"};
  }
  function matches(q, s) {
    if (!s) return true;
    let m = /^label:\s*(.*)$/.exec(s);
    if (m) return q.label != null && String(q.label).toLowerCase() === m[1].trim();
    m = /^#(\d+)$/.exec(s);
    if (m) return q.t === Number(m[1]);
    if (/^\d+$/.test(s) && q.t === Number(s)) return true;
    if (q._lc === undefined) q._lc = ((q.text || "") + "\n" + (q.tok ? q.tok.join("") : "")).toLowerCase();
    return q._lc.includes(s);
  }
  function setFilter() {
    const s = search.value.trim().toLowerCase();
    const before = shown.length ? Q[shown[cur]].t : null;
    shown = [];
    Q.forEach((q, i) => { if (matches(q, s)) shown.push(i); });
    const keep = shown.findIndex((i) => Q[i].t === before);
    select(keep >= 0 ? keep : 0, false);
  }
  let drawn = null;  // the list page on screen: [shown, page]; redrawn only when either changes
  function select(pos, scroll) {
    cur = Math.max(0, Math.min(pos, shown.length - 1));
    page = Math.floor(cur / PAGE);
    picked = null;
    if (!drawn || drawn[0] !== shown || drawn[1] !== page) {
      renderList();
      drawn = [shown, page];
    } else {
      for (const li of list.children) li.classList.toggle("sel", Number(li.dataset.pos) === cur);
    }
    renderDetail();
    if (shown.length) {
      try { history.replaceState(null, "", "#" + Q[shown[cur]].t); } catch (e) { /* a page without history */ }
      if (scroll !== false) {
        const li = list.querySelector("li.sel");
        if (li) li.scrollIntoView({block: "nearest"});
      }
    }
  }
  function renderList() {
    list.textContent = "";
    const pages = Math.max(1, Math.ceil(shown.length / PAGE));
    page = Math.max(0, Math.min(page, pages - 1));
    const end = Math.min(shown.length, (page + 1) * PAGE);
    for (let i = page * PAGE; i < end; i++) {
      const q = Q[shown[i]];
      const li = el("li", i === cur ? "sel" : null);
      li.dataset.target = q.t;
      li.dataset.pos = i;
      if (IMG && q.img) li.appendChild(picture(q.img, 26));
      li.appendChild(el("span", "idx", "#" + q.t));
      if (q.label != null) li.appendChild(el("span", "lab", "label " + q.label));
      if (q.text != null) li.appendChild(el("span", "snip", q.text));
      li.addEventListener("click", () => select(i, false));
      list.appendChild(li);
    }
    count.textContent = shown.length === Q.length ? Q.length + " targets" : shown.length + " of " + Q.length + " targets";
    $("page-info").textContent = "page " + (page + 1) + " of " + pages;
    $("page-prev").disabled = page === 0;
    $("page-next").disabled = page >= pages - 1;
  }
  function card(q, key, e, rank, top) {
    const d = DOCS[String(e.d)] || {};
    const c = el("article", "card");
    c.dataset.train = e.d;
    const cap = el("div", "cap");
    const who = IMG ? el("span", "who") : cap;
    who.appendChild(el("span", "rank", (rank + 1) + "."));
    who.appendChild(el("span", "idx", "#" + e.d));
    if (d.label != null) who.appendChild(el("span", "lab", "label " + d.label));
    if (IMG) cap.appendChild(who);
    cap.appendChild(el("span", "score " + (e.s > 0 ? "pos" : e.s < 0 ? "neg" : ""), fmt(e.s)));
    if (!IMG && e.s != null && top > 0) {
      const bar = el("span", "bar");
      bar.style.width = Math.max(1, Math.round(60 * Math.abs(e.s) / top)) + "px";
      bar.title = "|score| relative to the largest of this target";
      cap.appendChild(bar);
    }
    c.appendChild(cap);
    if (IMG && d.img) c.appendChild(picture(d.img, 96));
    let body = null;
    if (e.dc) body = tokens(e.dt || d.tok || [], e.dc);
    else if (d.text != null) body = el("div", "doc-text", d.text);
    if (body) { c.appendChild(body); clamp(body, c); }
    if (q.tok && e.tc) {
      c.classList.add("pickable");
      if (picked && picked.key === key && picked.rank === rank) c.classList.add("picked");
      c.title = "click: shade the target's tokens by this document's contributions";
      c.addEventListener("click", () => {
        picked = picked && picked.key === key && picked.rank === rank ? null : {key: key, rank: rank};
        renderDetail();
      });
    }
    return c;
  }
  function renderDetail() {
    detail.textContent = "";
    if (!shown.length) {
      delete detail.dataset.target;
      detail.appendChild(el("p", "empty-state", "No target matches the filter."));
      return;
    }
    const q = Q[shown[cur]];
    detail.dataset.target = q.t;
    const head = el("div", "qhead");
    const prev = el("button", null, "\u2039 previous"), next = el("button", null, "next \u203a");
    prev.type = next.type = "button";
    prev.id = "prev"; next.id = "next";
    prev.disabled = cur === 0; next.disabled = cur >= shown.length - 1;
    prev.addEventListener("click", () => move(-1));
    next.addEventListener("click", () => move(1));
    const h = el("h2", null, "Target #" + q.t);
    if (q.label != null) h.appendChild(el("span", "badge", "label " + q.label));
    head.append(prev, h, next, el("span", "where", (cur + 1) + " of " + shown.length));
    detail.appendChild(head);

    const box = el("section", "query");
    const body = el("div", "qbody");
    if (IMG && q.img) body.appendChild(picture(q.img, 150));
    const shade = shading(q);
    if (shade) {
      const t = tokens(shade.texts, shade.values);
      t.classList.add("qtext");
      body.appendChild(t);
    } else if (q.text != null) {
      body.appendChild(el("div", "qtext", q.text));
    }
    const facts = el("div", "facts");
    if (q.p.length && q.p[0].s != null) facts.appendChild(el("div", null, "highest score " + fmt(q.p[0].s) + " (train #" + q.p[0].d + ")"));
    if (q.o.length && q.o[0].s != null) facts.appendChild(el("div", null, "lowest score " + fmt(q.o[0].s) + " (train #" + q.o[0].d + ")"));
    if (q.label != null) {
      for (const key of ["p", "o"]) {
        const same = q[key].filter((e) => DOCS[String(e.d)] && DOCS[String(e.d)].label === q.label).length;
        if (q[key].length) facts.appendChild(el("div", null, SIDE[key].name.toLowerCase() + " with label " + q.label + ": " + same + " of " + q[key].length));
      }
    }
    box.appendChild(body);
    if (facts.childNodes.length) (IMG ? body : box).appendChild(facts);
    if (shade) {
      const note = el("p", "shade-note");
      const legend = el("span", "legend");
      const sw = (color, text) => { const s = el("span"); const i = el("i"); i.style.background = color; s.append(i, text); return s; };
      const grey = el("span");
      grey.append(el("span", "tok tx", "grey"), ": not a target of the loss");
      legend.append(sw("rgba(26,127,55,.7)", "raises the score"), sw("rgba(198,40,40,.7)", "lowers it"), grey,
                    "hover a token for its value");
      note.append("Target tokens shaded by " + shade.note + (picked ? "." : "; click a document to shade them by its own."));
      if (picked) {
        const b = el("button", null, "show the sum");
        b.type = "button";
        b.id = "show-sum";
        b.addEventListener("click", () => { picked = null; renderDetail(); });
        note.appendChild(b);
      }
      box.appendChild(note);
      const keys = el("p", "shade-note");
      keys.appendChild(legend);
      box.appendChild(keys);
    }
    detail.appendChild(box);

    let top = 0;
    for (const key of ["p", "o"]) for (const e of q[key]) if (e.s != null) top = Math.max(top, Math.abs(e.s));
    const sides = el("div", IMG ? "sides pics" : "sides");
    for (const key of ["p", "o"]) {
      const sec = el("section", "side " + SIDE[key].cls);
      sec.appendChild(el("h3", null, SIDE[key].name + ": " + SIDE[key].what));
      const cards = el("div", IMG ? "cards pics" : "cards");
      q[key].forEach((e, r) => cards.appendChild(card(q, key, e, r, top)));
      if (!q[key].length) cards.appendChild(el("p", null, "none: " + SIDE[key].none));
      sec.appendChild(cards);
      sides.appendChild(sec);
    }
    detail.appendChild(sides);
    detail.scrollTop = 0;
  }
  function move(step) {
    if (shown.length) select(cur + step);
  }
  function turn(step) {
    const pages = Math.max(1, Math.ceil(shown.length / PAGE));
    const p = Math.max(0, Math.min(page + step, pages - 1));
    if (p !== page) select(p * PAGE);
  }

  search.addEventListener("input", setFilter);
  $("page-prev").addEventListener("click", () => turn(-1));
  $("page-next").addEventListener("click", () => turn(1));
  document.addEventListener("keydown", (ev) => {
    if (ev.ctrlKey || ev.metaKey || ev.altKey) return;
    const typing = document.activeElement === search;
    if (ev.key === "/" && !typing) { ev.preventDefault(); search.focus(); search.select(); return; }
    if (ev.key === "Escape" && typing) { search.blur(); return; }
    if (ev.key === "ArrowDown" || (!typing && ev.key === "j")) { ev.preventDefault(); move(1); }
    else if (ev.key === "ArrowUp" || (!typing && ev.key === "k")) { ev.preventDefault(); move(-1); }
    else if (ev.key === "PageDown" && !typing) { ev.preventDefault(); turn(1); }
    else if (ev.key === "PageUp" && !typing) { ev.preventDefault(); turn(-1); }
  });
  const fromHash = /^#(\d+)$/.exec(location.hash);
  const start = fromHash ? Q.findIndex((q) => q.t === Number(fromHash[1])) : 0;
  select(Math.max(0, start));
})();
"""
