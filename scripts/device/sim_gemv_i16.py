# Lane-level model of the D24 int16 path (stage_x_i16_regs + Q4Rows::dot_i16): the exact shared-memory
# index math and dp2a semantics against a float dot product, for 1,024·CPL columns (written before any
# device run). Usage: python3 scripts/device/sim_gemv_i16.py
import numpy as np
rng=np.random.default_rng(2)
for CPL in (2,4):
  for dist in ("gauss","t2"):
    cols=CPL*1024
    x=(rng.standard_normal(cols) if dist=="gauss" else rng.standard_t(2,cols)).astype(np.float32)
    W=rng.integers(0,16,cols)
    words=np.zeros(cols//8,dtype=np.uint64)
    for k in range(cols): words[k//8] |= np.uint64(int(W[k]) << (4*(k%8)))
    words=words.astype(np.uint32)
    qx=np.zeros((cols//8)*4,dtype=np.uint32)  # cols/8 uint4
    xd=np.zeros(cols//32); 
    for idx in range(cols//4):
        v=x[4*idx:4*idx+4]; ci=idx>>3; fi=idx&7
        blk=x[32*ci:32*ci+32]; m=np.abs(blk).max(); inv=32767/m if m>0 else 0
        q=[int(np.rint(float(t)*inv))&0xFFFF for t in v]
        base=(((ci>>5)*4+(fi>>1))*32+(ci&31))*4 + (fi&1)*2
        qx[base]=q[0]|(q[2]<<16); qx[base+1]=q[1]|(q[3]<<16)
        if fi==0: xd[ci]=m/32767
    def s16(h): return h-65536 if h>32767 else h
    def s8(b): return b-256 if b>127 else b
    def dp2a(a,b,c,hi):
        o=16 if hi else 0
        return c+s16(a&0xFFFF)*s8((b>>o)&0xFF)+s16((a>>16)&0xFFFF)*s8((b>>(o+8))&0xFF)
    tot=0.0; M=0x0F0F0F0F
    for lane in range(32):
        for i in range(CPL):
            ci=lane+32*i; acc=0
            for f in range(4):
                b=(((4*i+f)*32+lane))*4; X=qx[b:b+4]; wf=int(words[4*ci+f]); lo=wf&M; hi=(wf>>4)&M
                acc=dp2a(int(X[0]),lo,acc,0); acc=dp2a(int(X[1]),hi,acc,0); acc=dp2a(int(X[2]),lo,acc,1); acc=dp2a(int(X[3]),hi,acc,1)
            tot+=acc*xd[ci]
    ref=float(W.astype(np.float64)@x.astype(np.float64))
    print(CPL,dist,"ref %.4f i16 %.4f rel %.2e"%(ref,tot,abs(tot-ref)/np.abs(W*x).sum()))
