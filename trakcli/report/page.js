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
