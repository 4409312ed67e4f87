import time, torch
from specgen.runtime import int8
torch.manual_seed(0)
SHAPES=[(1152,896),(896,896),(9728,896),(896,4864)]
L=24
def to_int4(w, group=32):
    n,k=w.shape; wg=w.float().reshape(n,k//group,group); lo,hi=wg.amin(-1),wg.amax(-1)
    s=((hi-lo)/15).clamp(min=1e-8); q=((wg-lo[...,None])/s[...,None]).round().clamp(0,15).to(torch.int32).reshape(n,k)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q,2), torch.stack([s,lo+8*s],-1).transpose(0,1).contiguous().bfloat16()
# distinct weights per layer so they stream from memory as in a real step
W=[[torch.randn(s)*0.02 for s in SHAPES] for _ in range(L)]
P8=[[torch.ops.quantized.linear_prepack(torch.quantize_per_channel(w, w.abs().amax(1)/127, torch.zeros(w.shape[0],dtype=torch.long),0,torch.qint8), None) for w in ws] for ws in W]
P4=[[to_int4(w) for w in ws] for ws in W]
xs=[torch.randn(1,s[1]) for s in SHAPES]
def med(f,r=9):
    f(); t=[]
    for _ in range(r):
        a=time.perf_counter(); f(); t.append(time.perf_counter()-a)
    return sorted(t)[r//2]*1e3
f8=lambda:[torch.ops.quantized.linear_dynamic(x,p,True) for ps in P8 for p,x in zip(ps,xs)]
f4=lambda:[torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(),p,32,sz).float() for ps in P4 for (p,sz),x in zip(ps,xs)]
for _ in range(2):
    print(f"draft layers' products, 1 row, 24 distinct layers: int8 dynamic {med(f8):.1f} ms, int4 {med(f4):.1f} ms")
