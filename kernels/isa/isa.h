// Selects the matrix ISA layer for the target being compiled; the kernel body sees only rdna::Isa.
#pragma once
#include "../platform/platform.h"

#if defined(__GFX11__)
#include "gfx11.h"
#elif defined(__GFX12__)
#include "gfx12.h"
#else
#error "unsupported target: gfx11 or gfx12 only"
#endif
