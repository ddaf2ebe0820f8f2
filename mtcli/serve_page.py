"""The page ``mtcli serve`` shows at ``/``: type or paste text, read its translation, or each
line's alternatives (n-best hypotheses or samples) with their scores."""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>mtcli</title>
<style>
  body { font-family: system-ui, sans-serif; max-width: 52rem; margin: 2rem auto; padding: 0 1rem; }
  textarea, #result { width: 100%; box-sizing: border-box; font-size: 1rem; padding: .5rem; }
  /* each line in its own script's direction: Arabic or Hebrew right to left, beside English */
  textarea, #result { unicode-bidi: plaintext; text-align: start; }
  textarea { height: 9rem; }
  #result { min-height: 9rem; border: 1px solid #999; white-space: pre-wrap; background: #f7f7f7; }
  .row { display: flex; gap: 1rem; align-items: center; margin: .75rem 0; flex-wrap: wrap; }
  #status { color: #555; }
  #status.error { color: #b00020; }
</style>
</head>
<body>
<h1>mtcli</h1>
<p>One sentence per line. <a href="/docs">API docs</a></p>
<label for="source">Text</label>
<textarea id="source" dir="auto" autofocus></textarea>
<div class="row">
  <button id="translate" type="button">Translate</button>
  <label>Search <select id="search">
    <option value="beam">beam</option>
    <option value="topk">sample (top-k)</option>
    <option value="topp">sample (top-p)</option>
  </select></label>
  <label>Beam <input id="beam" type="number" min="1" max="16" placeholder="server's" style="width:5rem"></label>
  <label>Alternatives <input id="nbest" type="number" min="1" max="16" value="1" style="width:4rem"></label>
  <label>Seed <input id="seed" type="number" min="0" step="1" placeholder="server's" style="width:6rem"></label>
  <label id="tgt-lang-label" hidden>Into <select id="tgt-lang"></select></label>
  <label>API key <input id="api-key" type="password" autocomplete="off"></label>
  <span id="status" role="status"></span>
</div>
<label for="result">Translation</label>
<div id="result" dir="auto" aria-live="polite"></div>
<script>
const $ = (id) => document.getElementById(id);
async function translate() {
  const lines = $("source").value.split("\\n");
  const headers = {"Content-Type": "application/json"};
  if ($("api-key").value) headers["Authorization"] = "Bearer " + $("api-key").value;
  $("status").className = ""; $("status").textContent = "translating...";
  $("translate").disabled = true;
  try {
    const request = {text: lines};
    // an empty box leaves the server's own setting (its --beam, its decode.seed); left empty, the
    // beam widens to the alternatives asked for. "beam" asks for a search also of a server that
    // samples unasked (--set decode.sampling=topk)
    if ($("search").value === "beam") {
      request.sampling = "none";
      if ($("beam").value !== "") request.beam = Number($("beam").value);
    } else {
      request.sampling = $("search").value;
      if ($("seed").value !== "") request.seed = Number($("seed").value);  // the same seed, the same samples
    }
    if (!$("tgt-lang-label").hidden) request.tgt_lang = $("tgt-lang").value;
    const n = Number($("nbest").value);
    if (n > 1) request.nbest = n;
    const answer = await fetch("/translate", {method: "POST", headers, body: JSON.stringify(request)});
    const body = await answer.json();
    if (!answer.ok) throw new Error(body.error || answer.statusText);
    $("result").textContent = body.nbest ? alternatives(body.nbest) : body.translations.join("\\n");
    $("status").textContent = "done (" + body.model + ")";
  } catch (err) {
    $("status").className = "error"; $("status").textContent = err.message;
  } finally {
    $("translate").disabled = false;
  }
}
// each line's hypotheses (or samples), numbered, with the score the search ranks them by
function alternatives(nbest) {
  return nbest.map((hyps) => hyps.map((h, i) => (i + 1) + ". " + h.text + "  (" + h.score.toFixed(2) + ")")
    .join("\\n")).join("\\n\\n");
}
// beam size means nothing to a sampler, and a seed nothing to beam search (also as the page
// loads: a browser may restore the last search chosen)
function searchChosen() {
  const beam = $("search").value === "beam";
  $("beam").disabled = !beam;
  $("seed").disabled = beam;
}
$("search").addEventListener("change", searchChosen);
searchChosen();
// a model of several target languages: offer them, its default first
fetch("/health").then((r) => r.json()).then((health) => {
  const langs = health.target_languages || [];
  if (langs.length < 2) return;
  for (const lang of langs) $("tgt-lang").add(new Option(lang, lang));
  $("tgt-lang-label").hidden = false;
}).catch(() => {});
$("translate").addEventListener("click", translate);
$("source").addEventListener("keydown", (e) => { if (e.key === "Enter" && e.ctrlKey) translate(); });
</script>
</body>
</html>
"""
