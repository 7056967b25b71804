#!/usr/bin/env python3
"""Lane-level model of attn_split_mma_kernel (D20, src/backend/cuda/attention.cu): runs the kernel's fragment
index math for one warp (two 16-position steps with masking) on random data, with the PTX layouts of
mma.m16n8k16 (A/B/C) and movmatrix.m8n8.trans written out, and compares the result with a direct softmax
attention. Run before the first device run of the kernel (2.7e-4 relative error = fp16 rounding of q, p);
rerun after changing its permutations. Usage: python3 scripts/device/sim_attn_mma.py"""
import numpy as np
rng = np.random.default_rng(0)
hd, H, NPOS = 256, 8, 40
K = rng.standard_normal((NPOS, hd)).astype(np.float16)
V = rng.standard_normal((NPOS, hd)).astype(np.float16)
Q = (rng.standard_normal((H, hd)) * 0.1).astype(np.float32)
lo, hi = 3, 3 + 27   # slice
log2e = 1.4426950408889634

def h16(x): return np.float16(x)
# mma m16n8k16: A (16x16), B (16x8) from lane fragments. Fragment -> matrix per the PTX layout.
def mma(Cfr, Afr, Bfr):
    A = np.zeros((16, 16)); B = np.zeros((16, 8)); C = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a = Afr[lane]  # 4 regs, each (lo, hi) pair
        A[g, 2*t], A[g, 2*t+1] = a[0]; A[g+8, 2*t], A[g+8, 2*t+1] = a[1]
        A[g, 2*t+8], A[g, 2*t+9] = a[2]; A[g+8, 2*t+8], A[g+8, 2*t+9] = a[3]
        b = Bfr[lane]
        B[2*t, g], B[2*t+1, g] = b[0]; B[2*t+8, g], B[2*t+9, g] = b[1]
        c = Cfr[lane]
        C[g, 2*t], C[g, 2*t+1], C[g+8, 2*t], C[g+8, 2*t+1] = c
    D = A @ B + C
    out = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        out.append([D[g, 2*t], D[g, 2*t+1], D[g+8, 2*t], D[g+8, 2*t+1]])
    return out
def movtrans(regs):  # regs[lane] = (lo, hi): row g, cols 2t, 2t+1 of an 8x8 matrix
    M = np.zeros((8, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        M[g, 2*t], M[g, 2*t+1] = regs[lane]
    MT = M.T
    return [(MT[lane>>2, 2*(lane&3)], MT[lane>>2, 2*(lane&3)+1]) for lane in range(32)]
def words(row_vals):  # 8 halves -> 4 (lo, hi) words
    return [(row_vals[2*i], row_vals[2*i+1]) for i in range(4)]
def perm(x, y, sel):
    return (x[0], y[0]) if sel == 0x5410 else (x[1], y[1])

qw = {}
for lane in range(32):
    g, t = lane >> 2, lane & 3
    qw[lane] = [words([float(h16(Q[g, 32*i + 8*t + e] * log2e)) for e in range(8)]) for i in range(8)]
acc = [[[0.0]*4 for _ in range(16)] for _ in range(32)]
m0 = [-3.4e38]*32; m1 = [-3.4e38]*32; l0 = [0.0]*32; l1 = [0.0]*32
for p0 in range(lo, hi, 16):
    kr = {}
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        kr[lane] = []
        for r in range(2):
            p = p0 + g + 8*r; p = p if p < hi else lo
            kr[lane].append([words([float(K[p, 32*i + 8*t + e]) for e in range(8)]) for i in range(8)])
    sc = [[0.0]*4 for _ in range(32)]
    for ks in range(16):
        i, w = ks >> 1, 2*(ks & 1)
        Afr = [[kr[l][0][i][w], kr[l][1][i][w], kr[l][0][i][w+1], kr[l][1][i][w+1]] for l in range(32)]
        Bfr = [[qw[l][i][w], qw[l][i][w+1]] for l in range(32)]
        sc = mma(sc, Afr, Bfr)
    vr = {}
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        vr[lane] = []
        for r in range(4):
            p = p0 + 2*t + (r & 1) + 8*(r >> 1); p = p if p < hi else lo
            vr[lane].append([words([float(V[p, 64*q + 8*g + e]) for e in range(8)]) for q in range(4)])
    # masks and softmax
    x0 = [0]*32; x1 = [0]*32
    for lane in range(32):
        g = lane >> 2
        if p0 + g >= hi: sc[lane][0] = sc[lane][1] = -3.4e38
        if p0 + g + 8 >= hi: sc[lane][2] = sc[lane][3] = -3.4e38
        x0[lane] = max(sc[lane][0], sc[lane][2]); x1[lane] = max(sc[lane][1], sc[lane][3])
    for o in (4, 8, 16):
        x0 = [max(x0[l], x0[l ^ o]) for l in range(32)]; x1 = [max(x1[l], x1[l ^ o]) for l in range(32)]
    e = {}
    c0 = [0]*32; c1 = [0]*32
    for l in range(32):
        n0, n1 = max(m0[l], x0[l]), max(m1[l], x1[l])
        c0[l], c1[l] = 2.0**max(m0[l]-n0, -1000), 2.0**max(m1[l]-n1, -1000)
        m0[l], m1[l] = n0, n1
        e[l] = [2.0**max(sc[l][0]-n0, -1000), 2.0**max(sc[l][1]-n1, -1000), 2.0**max(sc[l][2]-n0, -1000), 2.0**max(sc[l][3]-n1, -1000)]
        l0[l] = l0[l]*c0[l] + e[l][0] + e[l][2]; l1[l] = l1[l]*c1[l] + e[l][1] + e[l][3]
    pb0 = movtrans([(float(h16(e[l][0])), float(h16(e[l][1]))) for l in range(32)])
    pb1 = movtrans([(float(h16(e[l][2])), float(h16(e[l][3]))) for l in range(32)])
    for mt in range(16):
        q, w = mt >> 2, mt & 3
        Cfr = []
        for l in range(32):
            a = acc[l][mt]; Cfr.append([a[0]*c0[l], a[1]*c1[l], a[2]*c0[l], a[3]*c1[l]])
        Afr = []
        for l in range(32):
            v0, v1, v2, v3 = (vr[l][r][q][w] for r in range(4))
            Afr.append([perm(v0, v1, 0x5410), perm(v0, v1, 0x7632), perm(v2, v3, 0x5410), perm(v2, v3, 0x7632)])
        Bfr = [[pb0[l], pb1[l]] for l in range(32)]
        D = mma(Cfr, Afr, Bfr)
        for l in range(32): acc[l][mt] = D[l]
for o in (4, 8, 16):
    l0 = [l0[l] + l0[l ^ o] for l in range(32)]; l1 = [l1[l] + l1[l ^ o] for l in range(32)]
O = np.zeros((H, hd)); L = np.zeros(H); M = np.zeros(H)
for l in range(32):
    g, t = l >> 2, l & 3
    for mt in range(16):
        dim = 64*(mt >> 2) + 8*g + 2*(mt & 3)
        O[2*t, dim] = acc[l][mt][0]; O[2*t+1, dim] = acc[l][mt][1]
        O[2*t, dim+1] = acc[l][mt][2]; O[2*t+1, dim+1] = acc[l][mt][3]
    if g == 0:
        L[2*t], L[2*t+1], M[2*t], M[2*t+1] = l0[l], l1[l], m0[l], m1[l]
out = O / L[:, None]
# reference
S = (Q @ K[lo:hi].astype(np.float32).T) * log2e
P = 2.0 ** (S - S.max(1, keepdims=True))
ref = (P @ V[lo:hi].astype(np.float32)) / P.sum(1, keepdims=True)
print("max rel err", np.abs(out - ref).max() / np.abs(ref).max(), "M match", np.allclose(M, S.max(1), atol=1e-2))
