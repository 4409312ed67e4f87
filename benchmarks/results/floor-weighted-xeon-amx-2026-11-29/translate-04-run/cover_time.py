import sys, time
from specgen.cli.app import main
from specgen.runtime import pruned
_cover = pruned.PrunedHead.cover
_see = pruned.PrunedHead.see
LOG = []
def cover(self, chosen):
    t = time.perf_counter(); _cover(self, chosen); LOG.append(("cover", chosen, round(time.perf_counter() - t, 4))); open("/tmp/t04/cover.log", "a").write(repr(LOG[-1]) + "\n")
SEE = [0.0, 0]
def see(self, ids):
    t = time.perf_counter(); _see(self, ids); SEE[0] += time.perf_counter() - t; SEE[1] += 1
pruned.PrunedHead.cover = cover
pruned.PrunedHead.see = see
import atexit
atexit.register(lambda: print("COVER", LOG, "SEE total %.3f s over %d calls" % tuple(SEE), file=sys.stderr))
sys.argv[0] = "specgen"
main()
