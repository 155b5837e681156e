// Cross-lane moves shared by the gfx11 and gfx12 layers: both keep a 16x16 fragment's two halves in
// lanes l and l ^ 16, and both have v_permlanex16.
#pragma once

namespace rdna {

constexpr u32 kPermlaneIdentityLo = 0x76543210u;
constexpr u32 kPermlaneIdentityHi = 0xfedcba98u;

// The value lane l ^ 16 holds: one VALU op, no LDS round trip. FETCH_INACTIVE: permlanex16's.
template <bool FETCH_INACTIVE = true>
RDNA_DEV u32 other_half(u32 x) { return permlanex16<FETCH_INACTIVE>(x, kPermlaneIdentityLo, kPermlaneIdentityHi); }
RDNA_DEV float other_half(float x) { return as_f32(other_half(as_u32(x))); }

}  // namespace rdna
