import sys, time, torch
sys.path.insert(0, "/work/main/benchmarks")
from outside_products import default_pair
from specgen.runtime import kvcache
from specgen.runtime.lean import call_for
torch.set_num_threads(2)
pair = default_pair()
model = pair.draft.model
call = call_for(model, False)
with torch.inference_mode():
    prompt = (torch.arange(1000, 1000 + 1700)[None] * 7) % 30000
    kvcache.forward(call, kvcache.new_cache(model), prompt[:, :64], keep=1)
    for n in (69, 512, 1700, 512, 69, 1700):
        cache = kvcache.new_cache(model)
        t0 = time.perf_counter()
        for s in range(0, n, 256):  # the drafter's catch-up as a CPU row alone: PREFILL_CHUNK? all at once here
            kvcache.forward(call, cache, prompt[:, s:min(n, s + 256)], keep=1)
        print(n, "tokens: %.2f s" % (time.perf_counter() - t0), flush=True)
